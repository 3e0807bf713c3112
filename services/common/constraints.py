"""Output constraints (structured output) and their translation to llguidance grammars.

A request may carry one constraint: a JSON Schema, a regular expression, a Lark (or
GBNF) grammar, a list of choices, or "any JSON object". The frontend compiles it
once to validate it (no engine ever sees a bad one); the engine compiles it again
off its busy loop, and masks each step's logits with the grammar's allowed tokens.
Both sides use the same `llguidance_grammar` and the same options, so what the
frontend accepts the engine compiles.

The engine compiles strictly: a grammar warning that could let invalid output
through is an error there. What reaches it is exact because the frontend's
`check_constraint` rewrites a JSON Schema first (schema_support.py): a oneOf proved
disjoint becomes anyOf (exact); by default a oneOf that may overlap is followed as
anyOf and a keyword llguidance lacks that only narrows (`not`, `if`/`then`/`else`,
`uniqueItems`, `contains`, `dependentRequired`, ...) is left out, and the frontend
validates each finished output against the client's full schema instead; with
`strict` both are refused. An unknown `format` is an annotation in draft 2020-12
and is ignored. JSON output is compact, with ", " and ": " separators and no other
whitespace, so bounded schemas stay bounded; a schema may override that with
llguidance's `x-guidance` key.
"""

from __future__ import annotations

import enum
import json
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from services.common.schema_support import Draft, exact_one_of, relax, value_at

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
            return _schema_grammar(parse_schema(constraint.spec))
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
    except ConstraintError:
        raise
    except (ValueError, TypeError) as exc:
        raise ConstraintError(str(exc)) from None


def parse_schema(spec: str) -> dict[str, Any]:
    """The JSON Schema of a spec as an object (true is {}); ConstraintError if it is not
    JSON or not a schema."""
    try:
        schema = json.loads(spec)
    except json.JSONDecodeError as exc:
        raise ConstraintError(f"is not valid JSON: {exc}") from None
    except RecursionError:
        raise ConstraintError("is nested too deeply") from None
    if schema is True:
        return {}  # the schema that accepts any value
    if schema is False:
        raise ConstraintError("the schema false accepts no value at all")
    if not isinstance(schema, dict):
        raise ConstraintError(
            f"a JSON Schema is an object or a boolean, got {type(schema).__name__}")
    return schema


def _schema_grammar(schema: dict[str, Any]) -> str:
    import llguidance

    try:
        return llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=JSON_OPTIONS)
    except (ValueError, TypeError) as exc:
        raise ConstraintError(str(exc)) from None


@dataclass(frozen=True, slots=True)
class CheckedConstraint:
    """A client's constraint as the frontend accepted it."""

    engine: OutputConstraint
    """What the engines compile: the client's constraint, or its JSON Schema rewritten
    so that the grammar follows it exactly (see `check_constraint`)."""
    notes: tuple[str, ...] = ()
    """What the grammar does not enforce, one line each, for the response's warnings."""
    relaxed: tuple[str, ...] = ()
    """The keyword of each note (oneOf, not, ...), for the metrics."""
    output_schema: dict[str, Any] | None = None
    """The client's full schema, when finished outputs must be validated against it."""


def check_constraint(constraint: OutputConstraint, tokenizer: llguidance.LLTokenizer,
                     strict: bool = False) -> CheckedConstraint:
    """Compile the constraint for this tokenizer; ConstraintError unless it can be
    served. A JSON Schema is served exactly where llguidance can follow it; a oneOf it
    may only approximate as anyOf, and a keyword it lacks that only narrows the schema,
    are refused when `strict` and otherwise left to a check of the finished output.
    Every refusal names the JSON pointer of the part it is about."""
    if constraint.kind is not ConstraintKind.JSON_SCHEMA:
        compile_matcher(llguidance_grammar(constraint), tokenizer)
        return CheckedConstraint(constraint)
    draft = Draft(parse_schema(constraint.spec))
    draft.standard_dialects()
    unproved = exact_one_of(draft)
    matcher = _matcher(_schema_grammar(draft.schema), tokenizer)
    warnings = _serious(matcher.get_grammar_warnings())
    if not warnings:
        return CheckedConstraint(_spec_of(constraint, draft))
    relaxation = relax(draft, unproved, warnings, _warnings_of)
    if relaxation.unsupported:
        raise ConstraintError("unsupported keyword " + ", ".join(
            f"{p.rsplit('/', 1)[-1]} at {p}" for p in relaxation.unsupported))
    if relaxation.other_warnings:
        raise ConstraintError(f"unsupported: {relaxation.other_warnings[0]}")
    if strict and not relaxation.exact:
        raise ConstraintError(
            "this server follows JSON Schemas exactly or not at all (strict_json_schema): "
            + "; ".join([*(f"oneOf at {p} has branches that are not provably disjoint"
                           for p in relaxation.approximated),
                         *(f"unsupported keyword {p.rsplit('/', 1)[-1]} at {p}"
                           for p in relaxation.dropped)]))
    engine = _spec_of(constraint, draft)
    compile_matcher(llguidance_grammar(engine), tokenizer)
    _check_dropped(draft.client_schema(), relaxation.dropped)
    return CheckedConstraint(
        engine, tuple(relaxation.notes()),
        tuple(p.rsplit("/", 1)[-1] for p in (*relaxation.approximated, *relaxation.dropped)),
        draft.client_schema())


def exact_schema(schema: dict[str, Any]) -> dict[str, Any]:
    """The schema as a grammar follows it exactly (oneOfs proved disjoint as anyOf, a
    draft's URI in its standard spelling), for a schema embedded where no output check
    can follow (a tool call's arguments inside a grammar); ConstraintError naming each
    place that a grammar could only approximate."""
    draft = Draft(schema)
    draft.standard_dialects()
    unproved = exact_one_of(draft)
    warnings = _warnings_of(draft.schema)
    if not warnings:
        return draft.schema
    relaxation = relax(draft, unproved, warnings, _warnings_of)
    places = [*(f"oneOf at {p} has branches that are not provably disjoint"
                for p in relaxation.approximated),
              *(f"unsupported keyword {p.rsplit('/', 1)[-1]} at {p}"
                for p in (*relaxation.dropped, *relaxation.unsupported))]
    raise ConstraintError("; ".join(places) or f"unsupported: {warnings[0]}")


def _spec_of(constraint: OutputConstraint, draft: Draft) -> OutputConstraint:
    if not draft.changed:
        return constraint
    return OutputConstraint(ConstraintKind.JSON_SCHEMA, json.dumps(draft.schema))


def _warnings_of(schema: Any) -> list[str]:
    import llguidance

    failed, messages = llguidance.LLMatcher.validate_grammar_with_warnings(
        _schema_grammar(schema))
    if failed:
        raise ConstraintError(messages[0] if messages else "the schema does not compile")
    return _serious(messages)


def _check_dropped(schema: dict[str, Any], dropped: tuple[str, ...]) -> None:
    """The output check reads the keywords llguidance left out, whose form nothing has
    checked yet: each must be valid in the schema's draft (checking just them keeps a
    large schema's check cheap: the whole of a 250 kB one takes 0.4 s)."""
    import jsonschema

    validator = jsonschema.validators.validator_for(schema)
    for where in dropped:
        parent, _, key = where.rpartition("/")
        node = value_at(schema, parent)
        fragment = {key: node[key]}
        if "$schema" in schema:
            fragment["$schema"] = schema["$schema"]
        try:
            validator.check_schema(fragment)
        except jsonschema.SchemaError as exc:
            raise ConstraintError(f"{key} at {where} is not valid: {exc.message}") from None


def _lark_literal(text: str) -> str:
    if not text:
        raise ConstraintError("a choice is an empty string")
    # A JSON string is a valid Lark string literal for any text (same escapes).
    return json.dumps(text, ensure_ascii=False)


def compile_matcher(grammar: str, tokenizer: llguidance.LLTokenizer) -> llguidance.LLMatcher:
    """A fresh matcher at the grammar's start; ConstraintError unless the grammar compiles
    for this tokenizer without a warning that could let invalid output through. The
    frontend's check and the engine's compile both call this, so they never disagree."""
    matcher = _matcher(grammar, tokenizer)
    warnings = _serious(matcher.get_grammar_warnings())
    if warnings:
        raise ConstraintError(f"unsupported: {warnings[0]}")
    return matcher


def _matcher(grammar: str, tokenizer: llguidance.LLTokenizer) -> llguidance.LLMatcher:
    import llguidance

    matcher = llguidance.LLMatcher(tokenizer, grammar, log_level=0)
    if matcher.is_error():
        raise ConstraintError(matcher.get_error())
    return matcher


def _serious(warnings: list[str]) -> list[str]:
    """The warnings that mean the grammar could accept output the constraint does not."""
    return [w for w in warnings if not w.startswith(_HARMLESS_WARNINGS)]


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
