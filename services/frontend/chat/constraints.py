"""Structured-output constraints for the chat API's `tool_choice` and `response_format`.

`tool_choice: required` (or a named function) is enforced by a Lark grammar whose every
complete output is what the model's tool parser reads back as calls, with nothing else
around them: the parser's markers, a fixed `{"name": ..., "arguments": ...}` wrapper
written as literals, and each function's parameter schema embedded with `%json`.
The wrapper is literal rather than part of one big JSON schema so that each
function's schema stays its own document (its `$ref`s resolve as the client wrote
them), the name is tied to its own arguments, and "name" always comes first, as the
models were trained to write it.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from services.common.constraints import (
    JSON_OPTIONS,
    ConstraintError,
    ConstraintKind,
    OutputConstraint,
    exact_schema,
)
from services.frontend.chat.parsers.reasoning import THINK_END, THINK_START

if TYPE_CHECKING:
    import tokenizers

# Names need no escaping in any format (mistral v11+ even writes them outside JSON);
# chat requests are held to the same.
_FUNCTION_NAME = re.compile(r"[A-Za-z0-9_.\-]+")
# The calls' own JSON is as compact as their arguments.
_ITEM_SEPARATOR = str(JSON_OPTIONS["item_separator"])
_KEY_SEPARATOR = str(JSON_OPTIONS["key_separator"])


@dataclass(frozen=True)
class FunctionSpec:
    name: str
    parameters: dict[str, Any]
    """The arguments object's JSON schema; {} accepts any object."""


@dataclass(frozen=True)
class _Format:
    """How one tool parser expects calls to be written."""

    opening: tuple[str, ...]
    """Markers and text before the first call, in order."""
    call_opening: tuple[str, ...]
    arguments_key: str
    call_closing: tuple[str, ...]
    separator: tuple[str, ...]
    """Between two calls."""
    closing: tuple[str, ...]
    """After the last call."""


_FORMATS = {
    # Qwen2.5/Qwen3 write each call in its own tags, one per line.
    "hermes": _Format((), ("<tool_call>", "\n"), "arguments", ("\n", "</tool_call>"),
                      ("\n",), ()),
    # The parser drops `;` and whitespace between calls; "; " is what Llama writes.
    "llama3_json": _Format((), (), "parameters", (), ("; ",), ()),
    # The JSON-list form of [TOOL_CALLS] (tokenizers up to v7), compact like its items.
    "mistral": _Format(("[TOOL_CALLS]", "["), (), "arguments", (), (_ITEM_SEPARATOR,),
                       ("]",)),
}


def added_token_ids(tokenizer: tokenizers.Tokenizer) -> dict[str, int]:
    """The tokens that are special to llguidance (content -> id): every added token,
    whether or not the tokenizer marks it special. llguidance (1.9.1) reads all added
    tokens as special, so a grammar's text never matches one (Qwen's `<tool_call>`,
    not special to the tokenizer, included); only its id does."""
    return {token.content: token_id
            for token_id, token in tokenizer.get_added_tokens_decoder().items()}


def tool_call_constraint(parser: str, functions: Sequence[FunctionSpec], *, parallel: bool,
                         special_tokens: Mapping[str, int]) -> OutputConstraint:
    """A GRAMMAR constraint whose every complete output is one call (parallel=False) or
    one or more calls (parallel=True) of one of `functions`, written in the parser's
    format, with arguments valid against that function's schema. A single function
    forces that one. ValueError for an unknown parser, no functions, a name the formats
    cannot carry, or a parameter schema that is not an object schema; a schema
    llguidance cannot follow is a ConstraintError when the grammar is compiled."""
    try:
        form = _FORMATS[parser]
    except KeyError:
        known = ", ".join(sorted(_FORMATS))
        raise ValueError(f"no tool-call grammar for parser {parser!r} (known: {known})") from None
    if not functions:
        raise ValueError("no function to call")

    def pieces(parts: tuple[str, ...]) -> list[str]:
        return [_lark_piece(part, special_tokens) for part in parts]

    rules: list[str] = []
    seen: set[str] = set()
    for index, function in enumerate(functions):
        name = function.name
        if not _FUNCTION_NAME.fullmatch(name):
            raise ValueError(f"function name {name!r} has characters outside [A-Za-z0-9_.-]")
        if name in seen:
            raise ValueError(f"function {name!r} is given twice")
        seen.add(name)
        head = (f'{{"name"{_KEY_SEPARATOR}{json.dumps(name)}{_ITEM_SEPARATOR}'
                f'"{form.arguments_key}"{_KEY_SEPARATOR}')
        body = [*pieces(form.call_opening), _lark_literal(head), f"args_{index}",
                _lark_literal("}"), *pieces(form.call_closing)]
        rules.append(f"call_{index}: " + " ".join(body))
        rules.append(f"args_{index}: %json " + json.dumps(_arguments_schema(function)))
    calls = " | ".join(f"call_{index}" for index in range(len(functions)))
    repeat = f" ({' '.join(pieces(form.separator))} call)*" if parallel else ""
    start = " ".join([*pieces(form.opening), "call" + repeat, *pieces(form.closing)])
    lines = [f"start: {start}", f"call: {calls}", *rules]
    return OutputConstraint(ConstraintKind.GRAMMAR, "\n".join(lines) + "\n")


def response_format_constraint(kind: str, json_schema: str) -> OutputConstraint | None:
    """The constraint of a chat request's `response_format` type; None for plain text."""
    if kind == "text":
        return None
    if kind == "json_object":
        return OutputConstraint(ConstraintKind.JSON_OBJECT)
    if kind == "json_schema":
        return OutputConstraint(ConstraintKind.JSON_SCHEMA, json_schema)
    raise ValueError(f"unknown response_format type {kind!r} (known: text, json_object, "
                     "json_schema)")


def with_reasoning_prefix(constraint: OutputConstraint, *, opened: bool, required: bool,
                          special_tokens: Mapping[str, int]) -> OutputConstraint:
    """The constraint, applied to the answer after the model's reasoning.

    A reasoning model thinks first, freely, and the constraint holds from `</think>`
    on (and the newlines the models write after it); otherwise the answer's JSON or
    call would be forced into the think block, where the reasoning parser files it
    as reasoning. `opened`: the prompt already opened `<think>`. `required`: the
    parser counts everything before `</think>` as reasoning even when nothing opened
    it (deepseek_r1), so the block must end before the answer; otherwise the block is
    optional and, when the prompt did not open it, starts with `<think>`.
    """
    end = special_tokens.get(THINK_END)
    if end is not None:
        # Any token but the one that ends the block; tokens rather than free text,
        # because llguidance's text never matches an added token (a model may well
        # think about <tool_call>).
        think = f"think: <[^{end}]>* <[{end}]>"
    else:
        # The shortest text that ends with the marker. Added tokens cannot occur in
        # it, a limit only of vocabularies without think tokens of their own.
        think = f"think[lazy]: REASONING {_lark_literal(THINK_END)}"
    opening = "" if opened else _lark_piece(THINK_START, special_tokens) + " "
    if not opened and required:
        opening = f"({opening.strip()})? "
    block = f"{opening}think BREAK?"
    start = f"start: {block} answer" if opened or required else f"start: ({block})? answer"
    lines = [start, think, r'BREAK: "\n" | "\n\n"', _answer_rules(constraint)]
    if end is None:
        lines.append(r"REASONING: /(.|\n)*/")
    return OutputConstraint(ConstraintKind.GRAMMAR, "\n".join(lines) + "\n")


def _answer_rules(constraint: OutputConstraint) -> str:
    """The constraint as Lark rules whose start rule is `answer`."""
    if constraint.kind is ConstraintKind.GRAMMAR:
        if not constraint.spec.startswith("start: "):
            raise ValueError("only tool-call grammars take a reasoning prefix")
        return "answer: " + constraint.spec.removeprefix("start: ")
    if constraint.kind is ConstraintKind.JSON_OBJECT:
        schema: Any = {"type": "object"}
    elif constraint.kind is ConstraintKind.JSON_SCHEMA:
        try:
            schema = json.loads(constraint.spec)
        except json.JSONDecodeError as exc:
            raise ValueError(f"is not valid JSON: {exc}") from None
        if schema is True:
            schema = {}
        if not isinstance(schema, dict):
            raise ValueError("a JSON Schema for the answer must be an object")
    else:
        raise ValueError(f"a {constraint.kind.value} constraint takes no reasoning prefix")
    return "answer: %json " + json.dumps(_with_json_options(schema))


def _arguments_schema(function: FunctionSpec) -> dict[str, Any]:
    schema = dict(function.parameters)
    kind = schema.get("type")
    # The parsers take only an object as arguments; a schema that says nothing of the
    # type (as `{}` does) would otherwise let any JSON value through.
    if kind is None:
        schema["type"] = "object"
    elif kind != "object":
        raise ValueError(f"the parameters of {function.name!r} are not an object schema "
                         f"(type {kind!r})")
    try:
        # No output check follows a call's arguments (they sit inside the call's
        # grammar): what the grammar would only approximate is refused, by pointer.
        schema = exact_schema(schema)
    except ConstraintError as exc:
        raise ValueError(f"the parameters of {function.name!r} cannot be followed exactly "
                         f"in a tool call: {exc}") from None
    return _with_json_options(schema)


def _with_json_options(schema: dict[str, Any]) -> dict[str, Any]:
    # %json does not get the options that `llguidance_grammar` passes for JSON schemas:
    # without them it would write free whitespace and no-space separators. The schema's
    # own x-guidance still overrides them, as it does for a response schema.
    own = schema.get("x-guidance")
    return {**schema, "x-guidance": {**JSON_OPTIONS, **(own if isinstance(own, dict) else {})}}


def _lark_piece(text: str, special_tokens: Mapping[str, int]) -> str:
    """A marker that is one token is written as that token, the way the model was
    trained to write it (and the only way llguidance matches a special token)."""
    token_id = special_tokens.get(text)
    return f"<[{token_id}]>" if token_id is not None else _lark_literal(text)


def _lark_literal(text: str) -> str:
    # A JSON string is a valid Lark string literal for any text (same escapes).
    return json.dumps(text, ensure_ascii=False)
