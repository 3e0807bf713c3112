"""The frontend's check of output constraints, before a request is routed.

Compiling is the only sure test that llguidance can serve a constraint with this
model's tokenizer, so the frontend compiles each distinct constraint once (off the
event loop) and remembers the verdict: a schema sent with every request of a
workload is compiled on its first use only. The verdicts are bounded in number and
in characters, since a schema may be a megabyte.

A JSON Schema that the grammar can only approximate (see schema_support.py) is
accepted unless the server is strict, with an `OutputCheck` that validates each
finished output against the client's whole schema.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

import grpc

from services.common.constraints import (
    CheckedConstraint,
    ConstraintError,
    LazyTokenizer,
    OutputConstraint,
    UnsupportedTokenizer,
    check_constraint,
)
from services.common.model_info import ModelInfo
from services.frontend.errors import RequestError, invalid_argument
from services.frontend.tokenizer import TextTokenizer

log = logging.getLogger(__name__)

# Verdicts kept (each a constraint and what the check made of it), and their
# characters together: at the default size limit, the latter binds first for large
# schemas (64 Mi characters, about 128 MiB of text at most).
VERDICT_CACHE_SIZE = 256
VERDICT_CACHE_CHARS = 64 << 20


class OutputCheck:
    """Validates a finished output against the client's JSON Schema (jsonschema)."""

    def __init__(self, schema: dict[str, Any]) -> None:
        import jsonschema

        # Formats are not asserted: llguidance enforces those it knows while
        # generating and ignores the others, as draft 2020-12 allows.
        self._validator = jsonschema.validators.validator_for(schema)(schema)

    def failure(self, text: str) -> str | None:
        """Why the output does not validate; None when it does."""
        import json

        import jsonschema

        try:
            value = json.loads(text)
        except RecursionError:
            return "the output is nested too deeply to parse as JSON"
        except ValueError as exc:
            return f"the output is not JSON: {exc}"
        try:
            error = jsonschema.exceptions.best_match(self._validator.iter_errors(value))
        except (jsonschema.exceptions.JSONSchemaError, RecursionError) as exc:
            # A part of the schema the validator cannot read (checked at accept time
            # for the keywords llguidance left out, not for the rest).
            return f"the schema could not be checked: {exc}"
        if error is None:
            return None
        return f"{error.message} (at {error.json_path}, schema {_pointer(error)})"


def _pointer(error: Any) -> str:
    return "/" + "/".join(str(p) for p in error.absolute_schema_path)


@dataclass(frozen=True)
class Accepted:
    """A constraint the frontend accepted, and how."""

    checked: CheckedConstraint
    output_check: OutputCheck | None = None
    """Set when the grammar only approximates a JSON Schema."""


def _chars(constraint: OutputConstraint, verdict: Accepted | str) -> int:
    """What a verdict holds: the client's text, and the engines' when it differs."""
    if isinstance(verdict, str) or verdict.checked.engine is constraint:
        return constraint.size
    return constraint.size + verdict.checked.engine.size


class ConstraintChecker:
    def __init__(self, tokenizer: TextTokenizer, model: ModelInfo, max_chars: int,
                 strict_json_schema: bool = False) -> None:
        self._max_chars = max_chars
        self._strict = strict_json_schema
        self._tokenizer = LazyTokenizer(tokenizer.backend.to_str, model.vocab_size,
                                        model.eos_token_ids)
        self._verdicts: OrderedDict[OutputConstraint, Accepted | str] = OrderedDict()
        self._verdict_chars = 0
        self._lock = threading.Lock()

    async def check(self, constraint: OutputConstraint, field: str = "") -> Accepted:
        """How the constraint is served; INVALID_ARGUMENT naming the field (by default
        the sampling field that carries the constraint) and the reason, unless it can
        be."""
        field = field or constraint.field
        if constraint.size > self._max_chars:
            raise invalid_argument(
                field, f"{field} has {constraint.size} characters, at most {self._max_chars} "
                "are allowed (this server's max_constraint_chars)")
        with self._lock:
            verdict = self._verdicts.get(constraint)
            if verdict is not None:
                self._verdicts.move_to_end(constraint)
        if verdict is None:
            verdict = await asyncio.to_thread(self._compile, constraint)
            self._remember(constraint, verdict)
        if isinstance(verdict, str):
            raise invalid_argument(field, f"{field} is not a constraint this server can "
                                          f"follow: {verdict}")
        return verdict

    def _remember(self, constraint: OutputConstraint, verdict: Accepted | str) -> None:
        with self._lock:
            if constraint in self._verdicts:
                return
            self._verdicts[constraint] = verdict
            self._verdict_chars += _chars(constraint, verdict)
            while (len(self._verdicts) > VERDICT_CACHE_SIZE
                   or self._verdict_chars > VERDICT_CACHE_CHARS) and len(self._verdicts) > 1:
                self._verdict_chars -= _chars(*self._verdicts.popitem(last=False))

    def _compile(self, constraint: OutputConstraint) -> Accepted | str:
        # The tokenizer first: a model whose tokenizer llguidance refuses can serve no
        # constraint at all, which is the server's limit, not the request's fault.
        try:
            tokenizer = self._tokenizer.get()
        except UnsupportedTokenizer as exc:
            raise RequestError(grpc.StatusCode.FAILED_PRECONDITION, str(exc),
                               reason="CONSTRAINTS_UNSUPPORTED") from None
        try:
            checked = check_constraint(constraint, tokenizer, strict=self._strict)
        except ConstraintError as exc:
            return str(exc)
        if checked.output_schema is None:
            return Accepted(checked)
        log.info("accepted a JSON Schema the grammar approximates: %s", "; ".join(checked.notes))
        return Accepted(checked, OutputCheck(checked.output_schema))
