"""Tool-call and response_format constraints: what random walks through the grammar's
masks write is always what the model's tool parser reads back as valid calls, and
what is not a call in the format is refused."""

from __future__ import annotations

import json
import random
import re
from dataclasses import dataclass
from typing import Any

import jsonschema
import llguidance
import numpy as np
import pytest
from tokenizers import Tokenizer

from services.common.constraints import (
    ConstraintKind,
    OutputConstraint,
    build_tokenizer,
    compile_matcher,
    llguidance_grammar,
)
from services.common.tiny_checkpoint import train_byte_level_bpe
from services.frontend.chat.constraints import (
    FunctionSpec,
    added_token_ids,
    response_format_constraint,
    tool_call_constraint,
    with_reasoning_prefix,
)
from services.frontend.chat.parsers.reasoning import make_reasoning_parser
from services.frontend.chat.parsers.tools import make_tool_parser

EOS = "</s>"
_CORPUS = [
    '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}'
    "\n</tool_call>",
    '[TOOL_CALLS][{"name": "book_room", "arguments": {"guest": {"name": "Ann", "age": 30}}}]',
    '{"name": "ping", "parameters": {}}; {"name": "get_weather", "parameters": {"days": 3}}',
    "the quick brown fox jumps over the lazy dog, fahrenheit and celsius",
]

WEATHER = FunctionSpec("get_weather", {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 10},
        "unit": {"enum": ["celsius", "fahrenheit"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 14},
    },
    "required": ["city", "unit"],
    "additionalProperties": False,
})
BOOKING = FunctionSpec("book_room", {
    "type": "object",
    "properties": {
        "guest": {
            "type": "object",
            "properties": {
                "name": {"type": "string", "minLength": 1, "maxLength": 6},
                "age": {"type": "integer", "minimum": 18, "maximum": 120},
            },
            "required": ["name"],
            "additionalProperties": False,
        },
        "extras": {"type": "array", "items": {"enum": ["bed", "view", 3]}, "maxItems": 3},
        "vip": {"type": "boolean"},
    },
    "required": ["guest"],
    "additionalProperties": False,
})
# A function without parameters, as clients declare one.
PING = FunctionSpec("ping.v2", {"type": "object", "properties": {},
                                "additionalProperties": False})
FUNCTIONS = (WEATHER, BOOKING, PING)


@dataclass(frozen=True)
class Format:
    """A parser, a tokenizer for it, and how its calls are laid out (written here
    independently of the module under test)."""

    parser: str
    tokenizer: Tokenizer
    marker: str | None
    """A marker that must be written as its single added token."""

    def render(self, calls: list[tuple[str, Any]]) -> str:
        if self.parser == "hermes":
            return "\n".join(
                f"<tool_call>\n{json.dumps({'name': n, 'arguments': a}, ensure_ascii=False)}"
                "\n</tool_call>" for n, a in calls)
        if self.parser == "llama3_json":
            return "; ".join(json.dumps({"name": n, "parameters": a}, ensure_ascii=False)
                             for n, a in calls)
        return "[TOOL_CALLS]" + json.dumps([{"name": n, "arguments": a} for n, a in calls],
                                           ensure_ascii=False)

    def llg(self) -> llguidance.LLTokenizer:
        return build_tokenizer(self.tokenizer.to_str(), self.tokenizer.get_vocab_size(),
                               (self.tokenizer.token_to_id(EOS),))


def _tokenizer(special: tuple[str, ...] = (), plain: tuple[str, ...] = ()) -> Tokenizer:
    tokenizer = train_byte_level_bpe(_CORPUS * 4, 420, ("<unk>", "<s>", EOS))
    tokenizer.add_special_tokens(list(special))
    tokenizer.add_tokens(list(plain))
    return tokenizer


@pytest.fixture(scope="module")
def formats() -> dict[str, Format]:
    return {
        # Qwen's tokenizers add the tags as tokens that are not special.
        "hermes-tokens": Format("hermes", _tokenizer(plain=("<tool_call>", "</tool_call>")),
                                "<tool_call>"),
        "hermes-text": Format("hermes", _tokenizer(), None),
        "llama3_json": Format("llama3_json", _tokenizer(), None),
        "mistral": Format("mistral", _tokenizer(special=("[TOOL_CALLS]",)), "[TOOL_CALLS]"),
    }


def constraint_for(fmt: Format, functions: tuple[FunctionSpec, ...],
                   parallel: bool) -> OutputConstraint:
    return tool_call_constraint(fmt.parser, functions, parallel=parallel,
                                special_tokens=added_token_ids(fmt.tokenizer))


def walk(matcher: llguidance.LLMatcher, eos: int, rng: random.Random,
         max_steps: int = 400) -> list[int]:
    """A random path through the grammar's masks: any allowed token but EOS, and EOS
    now and then once the output is complete."""
    tokens: list[int] = []
    for _ in range(max_steps):
        if matcher.is_stopped():
            break
        allowed = np.flatnonzero(np.frombuffer(matcher.compute_logit_bias(), dtype=np.uint8))
        assert allowed.size, "the mask allows nothing"
        others = [int(t) for t in allowed if t != eos]
        if not others or (matcher.is_accepting() and rng.random() < 0.3):
            assert eos in allowed and matcher.is_accepting()
            break
        token = rng.choice(others)
        assert matcher.consume_token(token), matcher.get_error()
        tokens.append(token)
    else:
        pytest.fail("the walk did not end: a schema is unbounded")
    assert matcher.is_accepting() and not matcher.is_error()
    return tokens


_STRING = re.compile(r'"(?:[^"\\]|\\.)*"')


def layout(text: str) -> str:
    """The text with every JSON string emptied: its separators, keys' order and markers."""
    return _STRING.sub('""', text)


MODES = {
    "one call": (FUNCTIONS, False),
    "parallel": (FUNCTIONS, True),
    "named": ((BOOKING,), False),
}


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("name", ["hermes-tokens", "hermes-text", "llama3_json", "mistral"])
def test_every_walk_is_valid_calls_the_parser_reads(formats: dict[str, Format], name: str,
                                                    mode: str) -> None:
    fmt = formats[name]
    functions, parallel = MODES[mode]
    schemas = {f.name: f.parameters for f in functions}
    tok = fmt.llg()
    grammar = llguidance_grammar(constraint_for(fmt, functions, parallel))
    eos = fmt.tokenizer.token_to_id(EOS)
    counts = set()
    for seed in range(8):
        tokens = walk(compile_matcher(grammar, tok), eos, random.Random(seed))
        text = fmt.tokenizer.decode(tokens, skip_special_tokens=False)
        content, calls = make_tool_parser(fmt.parser).parse_whole(text)
        assert content.strip() == "", text
        assert calls if parallel else len(calls) == 1, text
        counts.add(len(calls))
        decoded = []
        for call in calls:
            assert call.name in schemas, text
            arguments = json.loads(call.arguments)
            jsonschema.validate(arguments, schemas[call.name])
            decoded.append((call.name, arguments))
        # Compact JSON, "name" first, and nothing but the format's own markers and
        # separators around it.
        assert layout(text) == layout(fmt.render(decoded)), text
        if fmt.marker is not None:
            assert fmt.tokenizer.token_to_id(fmt.marker) in tokens, "the marker was spelled out"
    if parallel:
        assert max(counts) > 1, "no walk made more than one call"


def consumes(tok: llguidance.LLTokenizer, grammar: str, tokens: list[int]) -> bool:
    """Whether the grammar takes these tokens and is then complete."""
    matcher = compile_matcher(grammar, tok)
    return all(matcher.consume_token(t) for t in tokens) and bool(matcher.is_accepting())


def accepts(fmt: Format, grammar: str, text: str) -> bool:
    ids = fmt.tokenizer.encode(text, add_special_tokens=False).ids
    return consumes(fmt.llg(), grammar, ids)


_ARGS = {"guest": {"name": "Ann"}}


@pytest.mark.parametrize("name", ["hermes-tokens", "hermes-text", "llama3_json", "mistral"])
def test_only_calls_in_the_format_are_accepted(formats: dict[str, Format], name: str) -> None:
    fmt = formats[name]
    one = llguidance_grammar(constraint_for(fmt, FUNCTIONS, parallel=False))
    many = llguidance_grammar(constraint_for(fmt, FUNCTIONS, parallel=True))
    call = fmt.render([("book_room", _ARGS)])
    two = fmt.render([("book_room", _ARGS), ("ping.v2", {})])
    assert accepts(fmt, one, call) and accepts(fmt, many, two)
    assert not accepts(fmt, one, two)
    assert not accepts(fmt, one, "Sure! " + call)
    assert not accepts(fmt, one, call + " done")
    assert not accepts(fmt, one, fmt.render([("unknown", {})]))
    assert not accepts(fmt, one, fmt.render([("book_room", {"guest": {"name": "Ann", "x": 1}})]))
    assert not accepts(fmt, one, fmt.render([("get_weather", {"city": "P", "unit": "kelvin"})]))
    assert not accepts(fmt, one, fmt.render([("book_room", {"guest": {"age": 30}})]))
    # Not compact, and arguments before the name: valid JSON, but not what we emit.
    assert not accepts(fmt, one, call.replace(": ", ":"))
    key = "parameters" if fmt.parser == "llama3_json" else "arguments"
    in_order = f'"name": "book_room", "{key}": {json.dumps(_ARGS)}'
    swapped = call.replace(in_order, f'"{key}": {json.dumps(_ARGS)}, "name": "book_room"')
    assert swapped != call and not accepts(fmt, one, swapped)


@pytest.mark.parametrize("name", ["hermes-tokens", "hermes-text", "llama3_json", "mistral"])
def test_a_list_of_calls_may_end_after_every_call(formats: dict[str, Format], name: str) -> None:
    """The model ends a `required` list when it likes: after each complete call (and
    the format's closing, for mistral's list) EOS is allowed, and so is the next call."""
    fmt = formats[name]
    tok = fmt.llg()
    grammar = llguidance_grammar(constraint_for(fmt, FUNCTIONS, parallel=True))
    eos = fmt.tokenizer.token_to_id(EOS)
    calls = [("ping.v2", {}), ("book_room", _ARGS), ("ping.v2", {})]
    for count in (1, 2, 3):
        matcher = compile_matcher(grammar, tok)
        text = fmt.render(calls[:count])
        for token in fmt.tokenizer.encode(text, add_special_tokens=False).ids:
            assert matcher.consume_token(token), matcher.get_error()
        allowed = np.flatnonzero(np.frombuffer(matcher.compute_logit_bias(), dtype=np.uint8))
        assert matcher.is_accepting() and eos in allowed, text
    one = llguidance_grammar(constraint_for(fmt, FUNCTIONS, parallel=False))
    matcher = compile_matcher(one, tok)
    for token in fmt.tokenizer.encode(fmt.render(calls[:1]), add_special_tokens=False).ids:
        assert matcher.consume_token(token)
    allowed = np.flatnonzero(np.frombuffer(matcher.compute_logit_bias(), dtype=np.uint8))
    assert [int(t) for t in allowed] == [eos] or matcher.is_stopped()


def test_a_named_function_is_the_only_one_allowed(formats: dict[str, Format]) -> None:
    fmt = formats["hermes-text"]
    grammar = llguidance_grammar(constraint_for(fmt, (BOOKING,), parallel=False))
    assert accepts(fmt, grammar, fmt.render([("book_room", _ARGS)]))
    assert not accepts(fmt, grammar, fmt.render([("ping.v2", {})]))


def pieces(tokenizer: Tokenizer, *parts: str) -> list[int]:
    return [t for p in parts for t in tokenizer.encode(p, add_special_tokens=False).ids]


def test_a_marker_token_cannot_be_spelled_out(formats: dict[str, Format]) -> None:
    for name, parts in [("mistral", ("[TOOL", "_CALLS]")),
                        ("hermes-tokens", ("<tool", "_call>"))]:
        fmt = formats[name]
        grammar = llguidance_grammar(constraint_for(fmt, (PING,), parallel=False))
        call = fmt.render([("ping.v2", {})])
        marker = fmt.marker
        assert marker is not None
        spelled = pieces(fmt.tokenizer, *parts, call[len(marker):])
        assert fmt.tokenizer.token_to_id(marker) not in spelled
        assert fmt.tokenizer.decode(spelled, skip_special_tokens=False) == call
        assert not consumes(fmt.llg(), grammar, spelled), name
        assert accepts(fmt, grammar, call), name


def test_llguidance_matches_an_added_token_only_by_id(formats: dict[str, Format]) -> None:
    # Why every added token counts as special here: llguidance 1.9.1 gives each one a
    # special-token marker byte, so "<tool_call>" in grammar text never matches
    # Qwen's added (not special) token. Should this change, literals could serve.
    fmt = formats["hermes-tokens"]
    token = fmt.tokenizer.token_to_id("<tool_call>")
    assert not fmt.tokenizer.get_added_tokens_decoder()[token].special
    assert added_token_ids(fmt.tokenizer)["<tool_call>"] == token
    literal = llguidance.LLMatcher.grammar_from_lark('start: "<tool_call>"')
    assert not consumes(fmt.llg(), literal, [token])
    by_id = llguidance.LLMatcher.grammar_from_lark(f"start: <[{token}]>")
    assert consumes(fmt.llg(), by_id, [token])


def test_marker_text_is_accepted_when_it_is_no_token(formats: dict[str, Format]) -> None:
    fmt = formats["hermes-text"]
    assert "<tool_call>" not in added_token_ids(fmt.tokenizer)
    grammar = llguidance_grammar(constraint_for(fmt, (PING,), parallel=False))
    assert accepts(fmt, grammar, fmt.render([("ping.v2", {})]))


def test_empty_parameters_take_any_object_and_only_an_object(
        formats: dict[str, Format]) -> None:
    fmt = formats["llama3_json"]
    grammar = llguidance_grammar(constraint_for(fmt, (FunctionSpec("f", {}),), parallel=False))
    assert accepts(fmt, grammar, '{"name": "f", "parameters": {}}')
    assert accepts(fmt, grammar, '{"name": "f", "parameters": {"a": [1, {"b": null}]}}')
    assert not accepts(fmt, grammar, '{"name": "f", "parameters": [1]}')
    assert not accepts(fmt, grammar, '{"name": "f", "parameters": "x"}')


def test_a_schema_is_its_own_document_and_keeps_its_options(formats: dict[str, Format]) -> None:
    fmt = formats["llama3_json"]
    parameters = {
        "$defs": {"p": {"type": "object", "properties": {"x": {"type": "integer"}},
                        "required": ["x"], "additionalProperties": False}},
        "properties": {"p": {"$ref": "#/$defs/p"}},
        "required": ["p"],
        "additionalProperties": False,
        "x-guidance": {"key_separator": ":"},
    }
    original = json.loads(json.dumps(parameters))
    grammar = llguidance_grammar(
        constraint_for(fmt, (FunctionSpec("f", parameters),), parallel=False))
    assert parameters == original
    # The wrapper stays as the parser's format has it; the arguments follow the schema's
    # own x-guidance over the defaults.
    assert accepts(fmt, grammar, '{"name": "f", "parameters": {"p":{"x":7}}}')
    assert not accepts(fmt, grammar, '{"name": "f", "parameters": {"p": {"x": 7}}}')
    assert not accepts(fmt, grammar, '{"name": "f", "parameters": {"p":{"y":7}}}')


def test_what_llguidance_cannot_follow_is_refused_by_pointer(
    formats: dict[str, Format]
) -> None:
    # A call's arguments sit inside the call's grammar, where no output check can
    # follow: what the grammar would approximate is refused, with the place.
    fmt = formats["hermes-text"]
    overlap = {"oneOf": [{"type": "integer"}, {"type": "number"}]}
    for parameters, reason in [
        ({"type": "object", "properties": {"a": {"type": "array", "uniqueItems": True}}},
         "unsupported keyword uniqueItems at /properties/a/uniqueItems"),
        ({"type": "object", "properties": {"a": overlap}},
         "oneOf at /properties/a/oneOf has branches that are not provably disjoint"),
        ({"type": "object", "properties": {"a": {"type": "strin"}}}, "strin"),
        ({"type": "object", "properties": {"a": {"$ref": "#/nowhere"}}}, "nowhere"),
    ]:
        with pytest.raises(ValueError, match=reason) as info:
            constraint_for(fmt, (FunctionSpec("f", parameters),), parallel=False)
        assert "the parameters of 'f'" in str(info.value)


def test_a_oneof_proved_disjoint_is_followed_in_a_call(formats: dict[str, Format]) -> None:
    # pydantic's union of two models told apart by a const, through references.
    fmt = formats["hermes-text"]
    parameters = {"type": "object", "properties": {"shape": {
        "oneOf": [{"$ref": "#/$defs/C"}, {"$ref": "#/$defs/R"}]}}, "required": ["shape"],
        "$defs": {"C": {"type": "object", "properties": {"k": {"const": "c"}, "r": {
            "type": "integer"}}, "required": ["k", "r"]},
                  "R": {"type": "object", "properties": {"k": {"const": "r"}, "w": {
                      "type": "integer"}}, "required": ["k", "w"]}}}
    constraint = constraint_for(fmt, (FunctionSpec("f", parameters),), parallel=False)
    grammar = compile_matcher(llguidance_grammar(constraint), fmt.llg())
    assert grammar is not None


@pytest.mark.parametrize("parser, functions, reason", [
    ("hermes", (), "no function"),
    ("pythonic", (PING,), "pythonic"),
    ("hermes", (FunctionSpec("get weather", {}),), "'get weather'"),
    ("mistral", (FunctionSpec('a"b', {}),), "'a\"b'"),
    ("hermes", (FunctionSpec("", {}),), "''"),
    ("hermes", (PING, PING), "twice"),
    ("llama3_json", (FunctionSpec("f", {"type": "array"}),), "not an object schema"),
])
def test_what_no_format_can_carry_is_a_value_error(
        parser: str, functions: tuple[FunctionSpec, ...], reason: str) -> None:
    with pytest.raises(ValueError, match=re.escape(reason)):
        tool_call_constraint(parser, functions, parallel=True, special_tokens={})


def test_added_token_ids_are_every_added_token(formats: dict[str, Format]) -> None:
    ids = added_token_ids(formats["mistral"].tokenizer)
    assert ids == {"<unk>": 0, "<s>": 1, EOS: 2,
                   "[TOOL_CALLS]": formats["mistral"].tokenizer.token_to_id("[TOOL_CALLS]")}


def test_response_format_maps_to_a_constraint() -> None:
    schema = '{"type": "object", "properties": {"a": {"type": "integer"}}}'
    assert response_format_constraint("text", "") is None
    assert response_format_constraint("json_object", "") == OutputConstraint(
        ConstraintKind.JSON_OBJECT)
    assert response_format_constraint("json_schema", schema) == OutputConstraint(
        ConstraintKind.JSON_SCHEMA, schema)
    with pytest.raises(ValueError, match="'yaml'"):
        response_format_constraint("yaml", "")


# ---- the reasoning prefix -------------------------------------------------------------

_THINK_TOKENS = ("<think>", "</think>")


@pytest.fixture(scope="module")
def thinking() -> dict[str, Format]:
    # Qwen3 has the think tags as added tokens; other vocabularies spell them out.
    plain = ("<tool_call>", "</tool_call>")
    return {
        "tokens": Format("hermes", _tokenizer(plain=plain + _THINK_TOKENS), "<tool_call>"),
        "text": Format("hermes", _tokenizer(plain=plain), "<tool_call>"),
    }


def _prefixed(fmt: Format, constraint: OutputConstraint, *, opened: bool,
              required: bool = False) -> str:
    return llguidance_grammar(with_reasoning_prefix(
        constraint, opened=opened, required=required,
        special_tokens=added_token_ids(fmt.tokenizer)))


def _walk_after(fmt: Format, grammar: str, prefix: str, seed: int) -> str:
    """`prefix` fed to the grammar, then a random walk to the end; the whole text."""
    matcher = compile_matcher(grammar, fmt.llg())
    ids = fmt.tokenizer.encode(prefix, add_special_tokens=False).ids
    assert all(matcher.consume_token(t) for t in ids), matcher.get_error()
    tokens = walk(matcher, fmt.tokenizer.token_to_id(EOS), random.Random(seed))
    return fmt.tokenizer.decode(ids + tokens, skip_special_tokens=False)


@pytest.mark.parametrize("name", ["tokens", "text"])
@pytest.mark.parametrize("opened", [True, False])
def test_the_answer_after_reasoning_follows_the_constraint(
    thinking: dict[str, Format], name: str, opened: bool
) -> None:
    fmt = thinking[name]
    calls = tool_call_constraint("hermes", FUNCTIONS, parallel=False,
                                 special_tokens=added_token_ids(fmt.tokenizer))
    grammar = _prefixed(fmt, calls, opened=opened)
    # Markers that are added tokens may occur in reasoning, where they are text.
    reasoning = "the user wants weather " + ("<tool_call>" if name == "tokens" else "") + " {no"
    think = ("" if opened else "<think>\n") + reasoning + "\n</think>\n\n"
    for seed in range(4):
        text = _walk_after(fmt, grammar, think, seed)
        parser = make_reasoning_parser("qwen3", starts_in_reasoning=opened)
        thought, content = parser.parse_whole(text)
        assert thought == reasoning, text
        rest, [call] = make_tool_parser("hermes").parse_whole(content)
        assert rest == "" and call.name in {f.name for f in FUNCTIONS}
        jsonschema.validate(json.loads(call.arguments),
                            {f.name: f.parameters for f in FUNCTIONS}[call.name])
    # Reasoning is all there is until </think>: a call inside it completes nothing.
    inside = ("" if opened else "<think>") + fmt.render([("book_room", _ARGS)])
    assert not accepts(fmt, grammar, inside)


def test_without_an_opened_block_the_answer_may_come_at_once(
    thinking: dict[str, Format],
) -> None:
    fmt = thinking["tokens"]
    schema = OutputConstraint(ConstraintKind.JSON_SCHEMA, json.dumps(WEATHER.parameters))
    optional = _prefixed(fmt, schema, opened=False)
    answer = '{"city": "Oslo", "unit": "celsius"}'
    assert accepts(fmt, optional, answer)
    assert accepts(fmt, optional, "<think>\nhmm\n</think>\n\n" + answer)
    assert not accepts(fmt, optional, "hmm</think>" + answer)  # qwen3: no <think>, no block
    assert not accepts(fmt, optional, '{"city": "Oslo"}')  # the schema still holds
    # deepseek_r1 files everything before </think> as reasoning: the block must end.
    required = _prefixed(fmt, schema, opened=False, required=True)
    assert not accepts(fmt, required, answer)
    assert accepts(fmt, required, "hmm\n</think>\n\n" + answer)
    assert accepts(fmt, required, "<think>hmm</think>" + answer)
    json_object = _prefixed(fmt, OutputConstraint(ConstraintKind.JSON_OBJECT), opened=True)
    assert accepts(fmt, json_object, 'x</think>{"a": [1, 2]}')
    assert not accepts(fmt, json_object, 'x</think>{"a":1}')  # compact, like every schema


def test_a_prefix_takes_only_chat_constraints() -> None:
    for constraint in (OutputConstraint(ConstraintKind.REGEX, "a+"),
                       OutputConstraint(ConstraintKind.GRAMMAR, "root ::= \"a\""),
                       OutputConstraint(ConstraintKind.JSON_SCHEMA, "[1]")):
        with pytest.raises(ValueError):
            with_reasoning_prefix(constraint, opened=True, required=False, special_tokens={})
