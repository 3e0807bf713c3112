from __future__ import annotations

import random
from dataclasses import dataclass

import pytest

from services.frontend.chat.parsers.reasoning import (
    REASONING_PARSERS,
    DeepSeekR1ReasoningParser,
    Qwen3ReasoningParser,
    ReasoningDelta,
    make_reasoning_parser,
    prompt_opens_reasoning,
)
from services.frontend.chat.parsers.tools import ToolCall, make_tool_parser
from tests.unit.frontend.fakes import chunkings


@dataclass(frozen=True)
class Case:
    id: str
    parser: str
    starts_in_reasoning: bool
    output: str
    reasoning: str | None
    content: str


# Outputs as these models write them, special-token markers included.
CASES = [
    Case(
        "r1-distill: prompt opened <think>",
        "deepseek_r1",
        True,
        "Okay, so I need to find 12 * 13. Let me break it down: 12 * 10 = 120 and "
        "12 * 3 = 36, so 120 + 36 = 156.\n</think>\n\n12 × 13 = **156**.",
        "Okay, so I need to find 12 * 13. Let me break it down: 12 * 10 = 120 and "
        "12 * 3 = 36, so 120 + 36 = 156.",
        "12 × 13 = **156**.",
    ),
    Case(
        "r1: model writes <think> itself",
        "deepseek_r1",
        False,
        "<think>\nThe user wants the capital of France. That's Paris.\n</think>\n\n"
        "The capital of France is Paris.",
        "The user wants the capital of France. That's Paris.",
        "The capital of France is Paris.",
    ),
    Case(
        "r1: no opening tag anywhere, </think> still ends reasoning",
        "deepseek_r1",
        False,
        "Hmm, 2 + 2 is 4.\n</think>\n\nThe answer is 4.",
        "Hmm, 2 + 2 is 4.",
        "The answer is 4.",
    ),
    Case(
        "r1: cut by max_tokens inside reasoning",
        "deepseek_r1",
        True,
        "Let me think about this step by step.\nFirst, the train leaves at 9:00 and\n",
        "Let me think about this step by step.\nFirst, the train leaves at 9:00 and\n",
        "",
    ),
    Case(
        "r1: cut in the middle of </think>",
        "deepseek_r1",
        True,
        "So the answer is 7.\n</thi",
        "So the answer is 7.\n</thi",
        "",
    ),
    Case(
        "r1: empty reasoning",
        "deepseek_r1",
        True,
        "\n</think>\n\nHi! How can I help?",
        None,
        "Hi! How can I help?",
    ),
    Case(
        "r1: answer keeps its own blank lines and trailing newline",
        "deepseek_r1",
        True,
        "Two paragraphs.\n\n</think>\n\n\nFirst paragraph.\n\nSecond paragraph.\n",
        "Two paragraphs.",
        "First paragraph.\n\nSecond paragraph.\n",
    ),
    Case("r1: empty output", "deepseek_r1", True, "", None, ""),
    Case(
        "qwen3: enable_thinking false, all content",
        "qwen3",
        False,
        "Hello! How can I assist you today? 😊",
        None,
        "Hello! How can I assist you today? 😊",
    ),
    Case(
        "qwen3: original template, model opens <think>",
        "qwen3",
        False,
        "<think>\nOkay, the user said hello. I should greet them back and offer help.\n"
        "</think>\n\nHello! How can I help you today?",
        "Okay, the user said hello. I should greet them back and offer help.",
        "Hello! How can I help you today?",
    ),
    Case(
        "qwen3-2507 thinking: prompt opened <think>",
        "qwen3",
        True,
        "Okay, the user wants a haiku about rain. Five, seven, five syllables.\n</think>\n\n"
        "Soft rain on the roof\nwhispers to the sleeping town\nmorning comes washed clean",
        "Okay, the user wants a haiku about rain. Five, seven, five syllables.",
        "Soft rain on the roof\nwhispers to the sleeping town\nmorning comes washed clean",
    ),
    Case(
        "qwen3: /no_think writes an empty think block",
        "qwen3",
        False,
        "<think>\n\n</think>\n\nSure, here is the list:\n1. Apples\n2. Pears",
        None,
        "Sure, here is the list:\n1. Apples\n2. Pears",
    ),
    Case(
        "qwen3: <think> not at the start is text",
        "qwen3",
        False,
        "Wrap your reasoning in <think> and </think> tags.",
        None,
        "Wrap your reasoning in <think> and </think> tags.",
    ),
    Case(
        "qwen3: a later </think> in the answer is text",
        "qwen3",
        False,
        "<think>\nExplain the tag.\n</think>\n\nThe </think> tag closes the reasoning.",
        "Explain the tag.",
        "The </think> tag closes the reasoning.",
    ),
    Case(
        "qwen3: reasoning with look-alikes of the end marker",
        "qwen3",
        True,
        "Compare a < b, then </th and </thinking> are not the tag.\n\nDone\n</think>\n\nOK",
        "Compare a < b, then </th and </thinking> are not the tag.\n\nDone",
        "OK",
    ),
    Case(
        "qwen3: cut by max_tokens in reasoning the model opened",
        "qwen3",
        False,
        "<think>\nCounting: 1, 2, 3, 4",
        "Counting: 1, 2, 3, 4",
        "",
    ),
    Case(
        "qwen3: output that is only a partial <think>",
        "qwen3",
        False,
        "<thi",
        None,
        "<thi",
    ),
    Case(
        "qwen3: reasoning then a tool call in the content",
        "qwen3",
        True,
        "The user wants the weather in Paris; I'll call the tool.\n</think>\n\n"
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>',
        "The user wants the weather in Paris; I'll call the tool.",
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>',
    ),
]


def _stream(parser_name: str, starts_in_reasoning: bool, chunks: list[str]) -> ReasoningDelta:
    parser = make_reasoning_parser(parser_name, starts_in_reasoning)
    outs = [parser.feed(chunk) for chunk in chunks] + [parser.finish()]
    return ReasoningDelta("".join(o.reasoning for o in outs), "".join(o.content for o in outs))


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_whole_answer(case: Case) -> None:
    parser = make_reasoning_parser(case.parser, case.starts_in_reasoning)
    assert parser.parse_whole(case.output) == (case.reasoning, case.content)


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_every_chunking_streams_the_same_answer(case: Case) -> None:
    expected = ReasoningDelta(case.reasoning or "", case.content)
    for chunks in chunkings(case.output):
        assert _stream(case.parser, case.starts_in_reasoning, chunks) == expected, chunks


def test_end_marker_split_across_deltas_is_held_then_dropped() -> None:
    parser = Qwen3ReasoningParser(starts_in_reasoning=True)
    assert parser.feed("Paris.\n</th") == ReasoningDelta("Paris.", "")
    assert parser.feed("ink>\n") == ReasoningDelta("", "")
    assert parser.feed("\nThe capital is Paris.") == ReasoningDelta("", "The capital is Paris.")
    assert parser.finish() == ReasoningDelta("", "")


def test_start_marker_split_across_deltas() -> None:
    parser = Qwen3ReasoningParser(starts_in_reasoning=False)
    assert parser.feed("<th") == ReasoningDelta()
    assert parser.feed("ink>\nHm") == ReasoningDelta("Hm", "")


def test_content_start_is_not_held_without_a_possible_marker() -> None:
    parser = Qwen3ReasoningParser(starts_in_reasoning=False)
    assert parser.feed("Hi") == ReasoningDelta("", "Hi")
    # A `<` later in the content is text: the marker is only recognised at the start.
    assert parser.feed(" <") == ReasoningDelta("", " <")


def test_reasoning_newlines_wait_for_what_follows() -> None:
    parser = DeepSeekR1ReasoningParser(starts_in_reasoning=True)
    assert parser.feed("Step 1.\n") == ReasoningDelta("Step 1.", "")
    assert parser.feed("Step 2.") == ReasoningDelta("\nStep 2.", "")


def test_unfinished_reasoning_is_released_by_finish() -> None:
    parser = DeepSeekR1ReasoningParser(starts_in_reasoning=True)
    assert parser.feed("still thinking\n</thi") == ReasoningDelta("still thinking", "")
    assert parser.finish() == ReasoningDelta("\n</thi", "")


def test_deepseek_r1_reasons_even_when_the_prompt_did_not_open() -> None:
    assert DeepSeekR1ReasoningParser(False).parse_whole("no tags at all") == ("no tags at all", "")
    assert Qwen3ReasoningParser(False).parse_whole("no tags at all") == (None, "no tags at all")


def test_parse_whole_leaves_the_stream_untouched() -> None:
    parser = Qwen3ReasoningParser(starts_in_reasoning=True)
    assert parser.feed("abc") == ReasoningDelta("abc", "")
    assert parser.parse_whole("x</think>y") == ("x", "y")
    assert parser.feed("</think>z") == ReasoningDelta("", "z")


def test_prompt_opens_reasoning() -> None:
    assert prompt_opens_reasoning("<|User|>Hi<|Assistant|><think>\n")
    assert not prompt_opens_reasoning("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert not prompt_opens_reasoning("<|im_start|>assistant\n")


def test_registry() -> None:
    assert set(REASONING_PARSERS) == {"deepseek_r1", "qwen3"}
    assert isinstance(make_reasoning_parser("qwen3", True), Qwen3ReasoningParser)
    with pytest.raises(ValueError, match="unknown reasoning parser 'nope'"):
        make_reasoning_parser("nope", False)


def test_reasoning_then_tool_calls() -> None:
    """The chat layer's pipeline: the reasoning parser's content feeds the tool parser."""
    output = (
        "<think>\nThe user asks for the weather in Paris and in Tokyo. I have "
        "get_current_weather(location, unit); I'll call it for each city.\n</think>\n\n"
        "I'll check both cities.\n"
        "<tool_call>\n"
        '{"name": "get_current_weather", "arguments": {"location": "Paris, France", '
        '"unit": "celsius"}}\n'
        "</tool_call>\n"
        "<tool_call>\n"
        '{"name": "get_current_weather", "arguments": {"location": "東京", "unit": "celsius"}}\n'
        "</tool_call>"
    )
    expected_reasoning = (
        "The user asks for the weather in Paris and in Tokyo. I have "
        "get_current_weather(location, unit); I'll call it for each city."
    )
    expected_calls = [
        ("get_current_weather", '{"location":"Paris, France","unit":"celsius"}'),
        ("get_current_weather", '{"location":"東京","unit":"celsius"}'),
    ]
    for chunks in chunkings(output):
        reasoning_parser = make_reasoning_parser("qwen3", starts_in_reasoning=False)
        tool_parser = make_tool_parser("hermes", random.Random(7))
        reasoning: list[str] = []
        content: list[str] = []
        for chunk in chunks:
            split = reasoning_parser.feed(chunk)
            reasoning.append(split.reasoning)
            content.append(tool_parser.feed(split.content).content)
        split = reasoning_parser.finish()
        reasoning.append(split.reasoning)
        content.append(tool_parser.feed(split.content).content)
        content.append(tool_parser.finish().content)
        assert "".join(reasoning) == expected_reasoning
        assert "".join(content) == "I'll check both cities."
        calls: list[ToolCall] = tool_parser.calls
        assert [(c.name, c.arguments) for c in calls] == expected_calls
