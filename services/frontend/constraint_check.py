"""The frontend's check of output constraints, before a request is routed.

Compiling is the only sure test that llguidance can serve a constraint with this
model's tokenizer, so the frontend compiles each distinct constraint once (off the
event loop) and remembers the verdict: a schema sent with every request of a
workload is compiled on its first use only.
"""

from __future__ import annotations

import asyncio
import threading
from collections import OrderedDict

import grpc

from services.common.constraints import (
    ConstraintError,
    LazyTokenizer,
    OutputConstraint,
    UnsupportedTokenizer,
    compile_matcher,
    llguidance_grammar,
)
from services.common.model_info import ModelInfo
from services.frontend.errors import RequestError, invalid_argument
from services.frontend.tokenizer import TextTokenizer

# Verdicts kept (each a constraint and an error message or None).
VERDICT_CACHE_SIZE = 256


class ConstraintChecker:
    def __init__(self, tokenizer: TextTokenizer, model: ModelInfo, max_chars: int) -> None:
        self._max_chars = max_chars
        self._tokenizer = LazyTokenizer(tokenizer.backend.to_str, model.vocab_size,
                                        model.eos_token_ids)
        self._verdicts: OrderedDict[OutputConstraint, str | None] = OrderedDict()
        self._lock = threading.Lock()

    async def check(self, constraint: OutputConstraint, field: str = "") -> None:
        """INVALID_ARGUMENT naming the field (by default the sampling field that carries
        the constraint) and llguidance's reason, unless the constraint compiles."""
        field = field or constraint.field
        if constraint.size > self._max_chars:
            raise invalid_argument(
                field, f"{field} has {constraint.size} characters, at most {self._max_chars} "
                "are allowed (this server's max_constraint_chars)")
        with self._lock:
            known = constraint in self._verdicts
            error = self._verdicts.get(constraint)
            if known:
                self._verdicts.move_to_end(constraint)
        if not known:
            error = await asyncio.to_thread(self._compile, constraint)
            with self._lock:
                self._verdicts[constraint] = error
                while len(self._verdicts) > VERDICT_CACHE_SIZE:
                    self._verdicts.popitem(last=False)
        if error is not None:
            raise invalid_argument(field, f"{field} is not a constraint this server can "
                                          f"follow: {error}")

    def _compile(self, constraint: OutputConstraint) -> str | None:
        # The tokenizer first: a model whose tokenizer llguidance refuses can serve no
        # constraint at all, which is the server's limit, not the request's fault.
        try:
            tokenizer = self._tokenizer.get()
        except UnsupportedTokenizer as exc:
            raise RequestError(grpc.StatusCode.FAILED_PRECONDITION, str(exc),
                               reason="CONSTRAINTS_UNSUPPORTED") from None
        try:
            compile_matcher(llguidance_grammar(constraint), tokenizer)
        except ConstraintError as exc:
            return str(exc)
        return None
