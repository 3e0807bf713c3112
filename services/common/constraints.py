"""Output constraints (structured output) and their translation to llguidance grammars.

A request may carry one constraint: a JSON Schema, a regular expression, a Lark (or
GBNF) grammar, a list of choices, or "any JSON object". The frontend compiles it
once to validate it (no engine ever sees a bad one); the engine compiles it again
off its busy loop, and masks each step's logits with the grammar's allowed tokens.
Both sides use the same `llguidance_grammar` and the same options, so what the
frontend accepts the engine compiles.

JSON Schemas are compiled strictly: a keyword llguidance does not implement
(`uniqueItems`, `contains`, `not`, `if`/`then`, `dependentRequired`, ...) is an
error rather than silently ignored, since ignoring it could produce output that
does not validate. The exceptions are annotations that never restrict validity in
draft 2020-12: an unknown `format` is ignored. JSON output is compact, with ", "
and ": " separators and no other whitespace, so bounded schemas stay bounded; a
schema may override that with llguidance's `x-guidance` key.
"""

from __future__ import annotations

import enum
import json
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import llguidance

# Options for every JSON Schema compile (a schema's own "x-guidance" overrides them).
JSON_OPTIONS = {
    "whitespace_flexible": False,
    "item_separator": ", ",
    "key_separator": ": ",
    # Unimplemented keywords become warnings, which `_check_warnings` turns back into
    # errors unless they are harmless annotations.
    "lenient": True,
}
# Warnings about what may be ignored without ever accepting invalid output.
_HARMLESS_WARNINGS = ("Unknown format:",)


class ConstraintKind(enum.Enum):
    JSON_SCHEMA = "json_schema"
    REGEX = "regex"
    GRAMMAR = "grammar"
    CHOICE = "choice"
    JSON_OBJECT = "json_object"


class ConstraintError(ValueError):
    """The constraint cannot be compiled; the message is the reason, for the client."""


class UnsupportedTokenizer(ConstraintError):
    """llguidance cannot work with this model's tokenizer: no constraint can be served."""


@dataclass(frozen=True, slots=True)
class OutputConstraint:
    """One request's constraint; hashable, so that compiled grammars can be cached by it."""

    kind: ConstraintKind
    spec: str = ""
    """The schema, regex or grammar text (empty for choice and json_object)."""
    choices: tuple[str, ...] = ()

    @property
    def field(self) -> str:
        """The request field that carries it, for error messages."""
        return f"sampling.{self.kind.value}"

    @property
    def size(self) -> int:
        """Characters of the constraint, for the size limit."""
        return len(self.spec) + sum(len(c) for c in self.choices)


def llguidance_grammar(constraint: OutputConstraint) -> str:
    """The llguidance grammar of a constraint; ConstraintError if it cannot be built
    (the grammar's own errors show up when it is compiled, see `compile_matcher`)."""
    import llguidance

    kind = constraint.kind
    try:
        if kind is ConstraintKind.JSON_SCHEMA:
            schema = json.loads(constraint.spec)
            if schema is True:
                schema = {}  # the schema that accepts any value
            elif schema is False:
                raise ConstraintError("the schema false accepts no value at all")
            if not isinstance(schema, dict):
                raise ConstraintError(
                    f"a JSON Schema is an object or a boolean, got {type(schema).__name__}")
            return llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=JSON_OPTIONS)
        if kind is ConstraintKind.JSON_OBJECT:
            return llguidance.LLMatcher.grammar_from_json_schema(
                {"type": "object"}, defaults=JSON_OPTIONS)
        if kind is ConstraintKind.REGEX:
            return llguidance.LLMatcher.grammar_from_regex(constraint.spec)
        if kind is ConstraintKind.GRAMMAR:
            if not constraint.spec.strip():
                raise ConstraintError("the grammar is empty")
            if "::=" in constraint.spec:  # GBNF rules, converted to Lark
                return llguidance.grammar_from("gbnf", constraint.spec)
            return llguidance.LLMatcher.grammar_from_lark(constraint.spec)
        if not constraint.choices:
            raise ConstraintError("the list of choices is empty")
        # An alternation of the strings as Lark literals.
        lark = "start: " + " | ".join(_lark_literal(c) for c in constraint.choices)
        return llguidance.LLMatcher.grammar_from_lark(lark)
    except json.JSONDecodeError as exc:
        raise ConstraintError(f"is not valid JSON: {exc}") from None
    except ConstraintError:
        raise
    except (ValueError, TypeError) as exc:
        raise ConstraintError(str(exc)) from None


def _lark_literal(text: str) -> str:
    if not text:
        raise ConstraintError("a choice is an empty string")
    # A JSON string is a valid Lark string literal for any text (same escapes).
    return json.dumps(text, ensure_ascii=False)


def compile_matcher(grammar: str, tokenizer: llguidance.LLTokenizer) -> llguidance.LLMatcher:
    """A fresh matcher at the grammar's start; ConstraintError unless the grammar compiles
    for this tokenizer without a warning that could let invalid output through. The
    frontend's check and the engine's compile both call this, so they never disagree."""
    import llguidance

    matcher = llguidance.LLMatcher(tokenizer, grammar, log_level=0)
    if matcher.is_error():
        raise ConstraintError(matcher.get_error())
    _check_warnings(matcher.get_grammar_warnings())
    return matcher


def _check_warnings(warnings: list[str]) -> None:
    for warning in warnings:
        if not warning.startswith(_HARMLESS_WARNINGS):
            raise ConstraintError(f"unsupported: {warning}")


def build_tokenizer(tokenizer_json: str, vocab_size: int,
                    eos_token_ids: tuple[int, ...]) -> llguidance.LLTokenizer:
    """llguidance's view of the model's tokenizer, over the logits' `vocab_size` (ids
    past the tokenizer's own vocabulary are never allowed)."""
    import llguidance

    try:
        return llguidance.LLTokenizer(tokenizer_json, n_vocab=vocab_size,
                                      eos_token=list(eos_token_ids) or None)
    except Exception as exc:  # llguidance raises plain errors for tokenizers it refuses
        raise UnsupportedTokenizer(
            f"this model's tokenizer cannot serve output constraints (llguidance: {exc})"
        ) from None


class LazyTokenizer:
    """llguidance's tokenizer, built on first use and kept (thread-safe): a large
    vocabulary takes about a second, which a server that never sees a constraint
    should not pay at start. `tokenizer_json` is only called then."""

    def __init__(self, tokenizer_json: Callable[[], str], vocab_size: int,
                 eos_token_ids: tuple[int, ...]) -> None:
        self._tokenizer_json = tokenizer_json
        self._vocab_size = vocab_size
        self._eos_token_ids = eos_token_ids
        self._tokenizer: llguidance.LLTokenizer | None = None
        self._lock = threading.Lock()

    def get(self) -> llguidance.LLTokenizer:
        with self._lock:
            if self._tokenizer is None:
                self._tokenizer = build_tokenizer(self._tokenizer_json(), self._vocab_size,
                                                  self._eos_token_ids)
            return self._tokenizer
