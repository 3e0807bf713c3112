from __future__ import annotations

import random
import re
from dataclasses import dataclass

import pytest

from services.frontend.chat.parsers.tools import (
    TOOL_PARSERS,
    HermesToolParser,
    Llama3JsonToolParser,
    MistralToolParser,
    ParsedDelta,
    ToolCall,
    ToolCallDelta,
    make_tool_parser,
    pick_tool_parser,
)
from tests.unit.frontend.fakes import chunkings


@dataclass(frozen=True)
class Case:
    id: str
    parser: str
    output: str
    content: str
    calls: tuple[tuple[str, str], ...] = ()
    """(name, compact JSON arguments) of each call, in order."""


_PARIS = (
    '{"name": "get_current_weather", "arguments": {"location": "Paris, France", "unit": "celsius"}}'
)
_PARIS_ARGS = '{"location":"Paris, France","unit":"celsius"}'
_TOKYO = '{"name": "get_current_weather", "arguments": {"location": "東京", "unit": "celsius"}}'
_TOKYO_ARGS = '{"location":"東京","unit":"celsius"}'

HERMES_CASES = [
    Case(
        "one call",
        "hermes",
        f"<tool_call>\n{_PARIS}\n</tool_call>",
        "",
        (("get_current_weather", _PARIS_ARGS),),
    ),
    Case(
        "content then two calls",
        "hermes",
        f"I'll look up both cities.\n<tool_call>\n{_PARIS}\n</tool_call>\n"
        f"<tool_call>\n{_TOKYO}\n</tool_call>",
        "I'll look up both cities.",
        (("get_current_weather", _PARIS_ARGS), ("get_current_weather", _TOKYO_ARGS)),
    ),
    Case(
        "content after the calls",
        "hermes",
        f"<tool_call>\n{_PARIS}\n</tool_call>\n\nI've asked for the weather.",
        "I've asked for the weather.",
        (("get_current_weather", _PARIS_ARGS),),
    ),
    Case(
        "strings with braces, quotes and a closing tag look-alike",
        "hermes",
        '<tool_call>\n{"name": "run_python", "arguments": {"code": "print(\\"}]</tool\\")\\n'
        "x = {'a': [1, 2]}\"}}\n</tool_call>",
        "",
        (("run_python", '{"code":"print(\\"}]</tool\\")\\nx = {\'a\': [1, 2]}"}'),),
    ),
    Case(
        "no arguments, and arguments as a JSON string",
        "hermes",
        '<tool_call>\n{"name": "get_time"}\n</tool_call>\n<tool_call>\n'
        '{"name": "get_weather", "arguments": "{\\"city\\": \\"Oslo\\"}"}\n</tool_call>',
        "",
        (("get_time", "{}"), ("get_weather", '{"city":"Oslo"}')),
    ),
    Case(
        "bad JSON is content",
        "hermes",
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}\n</tool_call>',
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}\n</tool_call>',
    ),
    Case(
        "a call without a name is content",
        "hermes",
        'Result:\n<tool_call>\n{"arguments": {"city": "Oslo"}}\n</tool_call>',
        'Result:\n<tool_call>\n{"arguments": {"city": "Oslo"}}\n</tool_call>',
    ),
    Case(
        "cut by max_tokens inside the call",
        "hermes",
        'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Os',
        'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Os',
    ),
    Case(
        "well-formed JSON but no closing tag",
        "hermes",
        f"<tool_call>\n{_PARIS}\n",
        f"<tool_call>\n{_PARIS}\n",
    ),
    Case(
        "a malformed call, then a good one",
        "hermes",
        f"<tool_call>\n{{oops}}\n</tool_call>\n<tool_call>\n{_TOKYO}\n</tool_call>",
        "<tool_call>\n{oops}\n</tool_call>",
        (("get_current_weather", _TOKYO_ARGS),),
    ),
    Case(
        "an unclosed call, then a good one",
        "hermes",
        f'<tool_call>\n{{"name": "a"\n<tool_call>\n{_TOKYO}\n</tool_call>',
        '<tool_call>\n{"name": "a"',
        (("get_current_weather", _TOKYO_ARGS),),
    ),
    Case(
        "angle brackets in plain content",
        "hermes",
        "Use a < b, <toolbox> and <tool_calls> tags; end with <tool_",
        "Use a < b, <toolbox> and <tool_calls> tags; end with <tool_",
    ),
    Case("empty answer", "hermes", "", ""),
]

_LLAMA_PARIS = (
    '{"name": "get_current_conditions", "parameters": {"location": "Paris, FR", "unit": "Celsius"}}'
)
_LLAMA_PARIS_ARGS = '{"location":"Paris, FR","unit":"Celsius"}'

LLAMA3_CASES = [
    Case(
        "llama 3.1 json call",
        "llama3_json",
        _LLAMA_PARIS,
        "",
        (("get_current_conditions", _LLAMA_PARIS_ARGS),),
    ),
    Case(
        "after <|python_tag|>",
        "llama3_json",
        '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Berlin"}}',
        "",
        (("get_weather", '{"city":"Berlin"}'),),
    ),
    Case(
        "llama 3.2: several separated by ;",
        "llama3_json",
        '{"name": "get_weather", "parameters": {"city": "Paris"}}; '
        '{"name": "get_time", "parameters": {"timezone": "Europe/Paris"}}',
        "",
        (("get_weather", '{"city":"Paris"}'), ("get_time", '{"timezone":"Europe/Paris"}')),
    ),
    Case(
        '"arguments" instead of "parameters", leading newlines',
        "llama3_json",
        '\n\n{"type": "function", "name": "search", "arguments": {"query": "llama {3}"}}',
        "",
        (("search", '{"query":"llama {3}"}'),),
    ),
    Case(
        "plain answer",
        "llama3_json",
        "The capital of France is Paris. {Braces} later are text.",
        "The capital of France is Paris. {Braces} later are text.",
    ),
    Case(
        "a JSON answer that is not a call",
        "llama3_json",
        '{"name": "Alice", "age": 30}',
        '{"name": "Alice", "age": 30}',
    ),
    Case(
        "cut by max_tokens",
        "llama3_json",
        '{"name": "get_weather", "parameters": {"city": "Par',
        '{"name": "get_weather", "parameters": {"city": "Par',
    ),
    Case(
        "built-in tool code after <|python_tag|> is content",
        "llama3_json",
        '<|python_tag|>brave_search.call(query="weather in Paris")',
        '<|python_tag|>brave_search.call(query="weather in Paris")',
    ),
    Case(
        "a call, then a malformed one",
        "llama3_json",
        '{"name": "a", "parameters": {}}; {"name": b}',
        '{"name": b}',
        (("a", "{}"),),
    ),
    Case(
        "a call, then text",
        "llama3_json",
        f"{_LLAMA_PARIS}\n\nI have requested the current conditions.",
        "I have requested the current conditions.",
        (("get_current_conditions", _LLAMA_PARIS_ARGS),),
    ),
    Case(
        "calls on separate lines",
        "llama3_json",
        '{"name": "a", "parameters": {}}\n{"name": "b", "parameters": {}}',
        "",
        (("a", "{}"), ("b", "{}")),
    ),
    Case(
        "a trailing separator is dropped",
        "llama3_json",
        '{"name": "a", "parameters": {"x": [1, {"y": null}]}};\n',
        "",
        (("a", '{"x":[1,{"y":null}]}'),),
    ),
]

_MISTRAL_V3 = (
    '[TOOL_CALLS] [{"name": "get_current_weather", "arguments": '
    '{"location": "Paris, France", "format": "celsius"}}]'
)
_MISTRAL_ARGS = '{"location":"Paris, France","format":"celsius"}'

MISTRAL_CASES = [
    Case("v3 list", "mistral", _MISTRAL_V3, "", (("get_current_weather", _MISTRAL_ARGS),)),
    Case(
        "v3 list of two, after content",
        "mistral",
        'Sure, let me check.[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}},'
        ' {"name": "get_weather", "arguments": {"city": "Lyon"}}]',
        "Sure, let me check.",
        (("get_weather", '{"city":"Paris"}'), ("get_weather", '{"city":"Lyon"}')),
    ),
    Case(
        "v11 name[ARGS]",
        "mistral",
        '[TOOL_CALLS]get_current_weather[ARGS]{"location": "Paris, France", "format": "celsius"}',
        "",
        (("get_current_weather", _MISTRAL_ARGS),),
    ),
    Case(
        "v11 two calls after content",
        "mistral",
        'I will check both.[TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}'
        '[TOOL_CALLS]get_time[ARGS]{"tz": "Europe/Paris"}',
        "I will check both.",
        (("get_weather", '{"city":"Paris"}'), ("get_time", '{"tz":"Europe/Paris"}')),
    ),
    Case(
        "v11 with [CALL_ID]",
        "mistral",
        '[TOOL_CALLS]get_weather[CALL_ID]Xy7Qa2Lm9[ARGS]{"city": "Paris"}',
        "",
        (("get_weather", '{"city":"Paris"}'),),
    ),
    Case(
        "brackets in plain content",
        "mistral",
        "See [1] and [TOOL] docs, or [TOOL_CALLS",
        "See [1] and [TOOL] docs, or [TOOL_CALLS",
    ),
    Case(
        "v3 list cut by max_tokens",
        "mistral",
        '[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Par',
        '[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Par',
    ),
    Case(
        "v3 list with an element without a name",
        "mistral",
        '[TOOL_CALLS] [{"name": "a", "arguments": {}}, {"arguments": {}}]',
        '[TOOL_CALLS] [{"name": "a", "arguments": {}}, {"arguments": {}}]',
    ),
    Case(
        "prose after the marker is content",
        "mistral",
        "[TOOL_CALLS]I cannot call a tool for that.",
        "[TOOL_CALLS]I cannot call a tool for that.",
    ),
    Case(
        "v11 arguments that are not an object",
        "mistral",
        '[TOOL_CALLS]get_weather[ARGS]"Paris"',
        '[TOOL_CALLS]get_weather[ARGS]"Paris"',
    ),
    Case(
        "v11 cut inside the arguments, after a good call",
        "mistral",
        '[TOOL_CALLS]a[ARGS]{}[TOOL_CALLS]get_weather[ARGS]{"city": "Pa',
        '[TOOL_CALLS]get_weather[ARGS]{"city": "Pa',
        (("a", "{}"),),
    ),
    Case(
        "v11 cut before [ARGS]",
        "mistral",
        "[TOOL_CALLS]get_wea",
        "[TOOL_CALLS]get_wea",
    ),
]

CASES = HERMES_CASES + LLAMA3_CASES + MISTRAL_CASES


def _assemble(deltas: list[ToolCallDelta]) -> list[ToolCall]:
    """The calls a client rebuilds from the deltas, checking their shape: each call
    is one delta, with its index, id, name and arguments (OpenAI's first delta)."""
    calls: list[ToolCall] = []
    for delta in deltas:
        assert delta.index == len(calls) and delta.id and delta.name, delta
        calls.append(ToolCall(delta.id, delta.name, delta.arguments))
    return calls


def _stream(name: str, chunks: list[str], seed: int) -> tuple[str, list[ToolCall]]:
    parser = make_tool_parser(name, random.Random(seed))
    outs: list[ParsedDelta] = [parser.feed(chunk) for chunk in chunks] + [parser.finish()]
    calls = _assemble([d for out in outs for d in out.tool_calls])
    assert calls == parser.calls
    return "".join(out.content for out in outs), calls


@pytest.mark.parametrize("case", CASES, ids=[f"{c.parser}: {c.id}" for c in CASES])
def test_whole_answer(case: Case) -> None:
    content, calls = make_tool_parser(case.parser).parse_whole(case.output)
    assert content == case.content
    assert [(c.name, c.arguments) for c in calls] == list(case.calls)


@pytest.mark.parametrize("case", CASES, ids=[f"{c.parser}: {c.id}" for c in CASES])
def test_every_chunking_streams_the_same_answer(case: Case) -> None:
    whole = make_tool_parser(case.parser, random.Random(3)).parse_whole(case.output)
    for chunks in chunkings(case.output):
        assert _stream(case.parser, chunks, seed=3) == whole, chunks


def test_call_is_emitted_only_when_complete() -> None:
    parser = HermesToolParser(random.Random(0))
    assert parser.feed("Checking.\n<tool_") == ParsedDelta("Checking.")
    assert parser.feed('call>\n{"name": "f", "arguments": {"x": 1}}\n</tool') == ParsedDelta()
    out = parser.feed("_call>")
    assert out.content == ""
    call_id = parser.calls[0].id
    assert out.tool_calls == (ToolCallDelta(0, call_id, "f", '{"x":1}'),)
    assert parser.finish() == ParsedDelta()


def test_truncated_call_emits_no_delta_and_ends_as_content() -> None:
    text = '<tool_call>\n{"name": "f", "arguments": {"x": 1}}\n'
    parser = HermesToolParser()
    for char in text:
        assert parser.feed(char) == ParsedDelta()
    assert parser.finish() == ParsedDelta(text)
    assert parser.calls == []


CUT = {
    "hermes": ('Sure.\n<tool_call>\n{"name": "f", "arguments": {}}\n</tool_call>\n',
               ['<tool_call>\n{"name": "g", "arguments": {"x": 1}}\n</tool',
                "<tool_call>\n{\"na", "<tool_call>", "<tool_c", "<"]),
    "llama3_json": ('{"name": "f", "parameters": {}}; ',
                    ['{"name": "g", "parameters": {"x": ', "{", '{"name"']),
    "mistral": ('Sure. [TOOL_CALLS]f[ARGS]{}',
                ["[TOOL_CALLS]g[ARGS]{", "[TOOL_CALLS]get_", "[TOOL_CALLS]", "[TOOL_C"]),
}


@pytest.mark.parametrize("name", sorted(CUT))
def test_a_call_cut_by_max_tokens_is_dropped_and_the_calls_before_it_stand(name: str) -> None:
    complete, cuts = CUT[name]
    for cut in cuts:
        for chunks in chunkings(complete + cut):
            parser = make_tool_parser(name)
            outs = [parser.feed(chunk) for chunk in chunks] + [parser.finish(cut=True)]
            content = "".join(out.content for out in outs)
            assert content.strip() in ("", "Sure."), (cut, chunks)
            assert [c.name for c in _assemble([d for o in outs for d in o.tool_calls])] == ["f"]
    # The model's own end inside a call: malformed, its text is content.
    content, calls = make_tool_parser(name).parse_whole(complete + cuts[0])
    assert cuts[0].strip() in content and [c.name for c in calls] == ["f"]


def test_content_cut_by_max_tokens_is_kept() -> None:
    parser = HermesToolParser()
    assert parser.feed("It is sunny ") == ParsedDelta("It is sunny")
    assert parser.finish(cut=True) == ParsedDelta(" ")
    llama = Llama3JsonToolParser()
    assert llama.feed("Hi") == ParsedDelta("Hi")
    assert llama.finish(cut=True) == ParsedDelta()


def test_partial_marker_is_held_then_released_as_content() -> None:
    parser = MistralToolParser()
    assert parser.feed("See [TOOL") == ParsedDelta("See")
    assert parser.feed("S] docs") == ParsedDelta(" [TOOLS] docs")


def test_llama3_waits_for_the_start_of_the_answer() -> None:
    parser = Llama3JsonToolParser()
    assert parser.feed("<|pyth") == ParsedDelta()
    assert parser.feed("on_tag|>") == ParsedDelta()
    assert parser.feed('{"name": "f", "parameters": {}}').tool_calls[0].name == "f"
    plain = Llama3JsonToolParser()
    assert plain.feed("<b>Hi") == ParsedDelta("<b>Hi")


def test_ids() -> None:
    text = f"<tool_call>\n{_PARIS}\n</tool_call>\n<tool_call>\n{_TOKYO}\n</tool_call>"
    ids = [c.id for c in HermesToolParser().parse_whole(text)[1]]
    assert all(re.fullmatch(r"call_[A-Za-z0-9]{24}", i) for i in ids) and len(set(ids)) == 2
    seeded = [HermesToolParser(random.Random(5)).parse_whole(text)[1] for _ in range(2)]
    assert seeded[0] == seeded[1]

    (call,) = MistralToolParser().parse_whole(_MISTRAL_V3)[1]
    assert re.fullmatch(r"[A-Za-z0-9]{9}", call.id)
    # An id the model wrote is kept when it has Mistral's form, replaced otherwise.
    written = "[TOOL_CALLS]f[CALL_ID]{}[ARGS]{{}}"
    assert MistralToolParser().parse_whole(written.format("Xy7Qa2Lm9"))[1][0].id == "Xy7Qa2Lm9"
    replaced = MistralToolParser().parse_whole(written.format("call_1"))[1][0].id
    assert re.fullmatch(r"[A-Za-z0-9]{9}", replaced)


def test_registry() -> None:
    assert set(TOOL_PARSERS) == {"hermes", "llama3_json", "mistral"}
    assert isinstance(make_tool_parser("mistral"), MistralToolParser)
    with pytest.raises(ValueError, match="unknown tool parser 'nope'"):
        make_tool_parser("nope")


@pytest.mark.parametrize(
    ("template", "expected"),
    [
        # Fragments of the real templates.
        (
            "{{- '<|im_start|>assistant\\n' }}{%- if tools %}For each function call, return a "
            "json object with function name and arguments within <tool_call></tool_call> "
            "XML tags",
            "hermes",
        ),
        (
            "<tool_call>\\n<function=' + tool_call.name + '>\\n<parameter=",
            None,
        ),
        (
            "{%- if message.tool_calls %}{{- '[TOOL_CALLS]' }}{%- for tool in message.tool_calls",
            "mistral",
        ),
        (
            "{%- if builtin_tools is defined or tool_call.name in builtin_tools %}"
            "{{- '<|python_tag|>' + tool_call.name + '.call(' }}",
            "llama3_json",
        ),
        (
            "{{- '<|start_header_id|>user<|end_header_id|>\\n\\n' }}{%- if tools is not none %}"
            "{{- 'Given the following functions, please respond with a JSON for a function "
            "call\\n\\n' }}",
            "llama3_json",
        ),
        ("{{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' }}", None),
        ("{% for message in messages %}{{ message['content'] }}{% endfor %}", None),
    ],
)
def test_pick_tool_parser(template: str, expected: str | None) -> None:
    assert pick_tool_parser(template) == expected
