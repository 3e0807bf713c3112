from __future__ import annotations

import json
import math
from typing import Any

import openai.types
import openai.types.chat
import pytest
from corestream.common.v1 import common_pb2
from corestream.generate.v1 import chat_service_pb2 as chat_pb2
from corestream.generate.v1 import generate_service_pb2 as generate_pb2

from services.frontend.openai_api.responses import (
    CHAT_FINISH_REASONS,
    FINISH_REASONS,
    CompletionLogprobs,
    chat_chunk,
    chat_response,
    completion_chunk,
    completion_response,
    error_body,
    models_list,
    sum_usage,
    usage_chunk,
)

META = {"id": "cmpl-1", "model": "tiny", "created": 1700000000}
USAGE = common_pb2.Usage(prompt_tokens=5, completion_tokens=3, cached_tokens=2)
USAGE_JSON = {"prompt_tokens": 5, "completion_tokens": 3, "total_tokens": 8,
              "prompt_tokens_details": {"cached_tokens": 2}}


def _position(token: str, logprob: float, *top: tuple[str, float],
              token_id: int = 7, rank: int = 1) -> common_pb2.PositionLogprobs:
    # As the frontend fills them: a whole character's bytes are its text's.
    return common_pb2.PositionLogprobs(
        token_id=token_id, logprob=logprob, rank=rank, token=token, token_bytes=token.encode(),
        top=[common_pb2.TopLogprob(token_id=100 + i, logprob=lp, token=t, token_bytes=t.encode())
             for i, (t, lp) in enumerate(top)])


def _roundtrip(body: dict[str, Any]) -> dict[str, Any]:
    """What a client receives: the body must be plain JSON."""
    return json.loads(json.dumps(body, allow_nan=False))


@pytest.mark.parametrize(("reason", "expected"), [
    (common_pb2.FINISH_REASON_EOS_TOKEN, "stop"),
    (common_pb2.FINISH_REASON_STOP_TOKEN, "stop"),
    (common_pb2.FINISH_REASON_STOP_STRING, "stop"),
    (common_pb2.FINISH_REASON_STOP, "stop"),
    (common_pb2.FINISH_REASON_LENGTH, "length"),
    (common_pb2.FINISH_REASON_ABORT, "abort"),
    (common_pb2.FINISH_REASON_PAUSED, "abort"),
    (common_pb2.FINISH_REASON_SCHEMA_MISMATCH, "schema_mismatch"),
    (common_pb2.FINISH_REASON_UNSPECIFIED, None),
])
def test_finish_reasons(reason: int, expected: str | None) -> None:
    assert FINISH_REASONS.get(reason) == expected


@pytest.mark.parametrize(("reason", "expected"), [
    (chat_pb2.CHAT_FINISH_REASON_STOP, "stop"),
    (chat_pb2.CHAT_FINISH_REASON_LENGTH, "length"),
    (chat_pb2.CHAT_FINISH_REASON_TOOL_CALLS, "tool_calls"),
    (chat_pb2.CHAT_FINISH_REASON_ABORT, "abort"),
    (chat_pb2.CHAT_FINISH_REASON_PAUSED, "abort"),
    (chat_pb2.CHAT_FINISH_REASON_SCHEMA_MISMATCH, "schema_mismatch"),
    (chat_pb2.CHAT_FINISH_REASON_UNSPECIFIED, None),
])
def test_chat_finish_reasons(reason: int, expected: str | None) -> None:
    assert CHAT_FINISH_REASONS.get(reason) == expected


@pytest.mark.parametrize(("fields", "finish_reason", "stop_reason"), [
    ({"finish_reason": common_pb2.FINISH_REASON_STOP_STRING, "stop_string": "END"}, "stop",
     "END"),
    ({"finish_reason": common_pb2.FINISH_REASON_STOP_TOKEN, "stop_token_id": 42}, "stop", 42),
    # vLLM: the model's own EOS is no stop_reason.
    ({"finish_reason": common_pb2.FINISH_REASON_EOS_TOKEN, "stop_token_id": 1}, "stop", None),
    ({"finish_reason": common_pb2.FINISH_REASON_STOP}, "stop", None),
    ({"finish_reason": common_pb2.FINISH_REASON_LENGTH}, "length", None),
])
def test_completion_response_stop_reasons(fields: dict[str, Any], finish_reason: str,
                                          stop_reason: str | int | None) -> None:
    completion = generate_pb2.Completion(index=0, text="x", **fields)
    body = _roundtrip(completion_response([(0, completion)], USAGE, logprobs=False, **META))
    [choice] = body["choices"]
    assert (choice["finish_reason"], choice["stop_reason"]) == (finish_reason, stop_reason)
    openai.types.Completion.model_validate(body)


def test_constraint_warnings_are_a_top_level_list_only_when_there_are_some() -> None:
    warning = "not at /not is not enforced while generating"
    completion = generate_pb2.Completion(index=0, text="1",
                                         finish_reason=common_pb2.FINISH_REASON_SCHEMA_MISMATCH)
    whole = _roundtrip(completion_response([(0, completion)], USAGE, logprobs=False,
                                           warnings=[warning], **META))
    assert whole["warnings"] == [warning]
    assert whole["choices"][0]["finish_reason"] == "schema_mismatch"
    plain = _roundtrip(completion_response([(0, completion)], USAGE, logprobs=False, **META))
    assert "warnings" not in plain
    first = generate_pb2.GenerateStreamResponse(text="1", warnings=[warning])
    assert _roundtrip(completion_chunk(first, index=0, logprobs=None, **META))["warnings"] == [
        warning]
    chat = chat_pb2.ChatResponse(warnings=[warning], choices=[chat_pb2.ChatChoice(
        content="1", finish_reason=chat_pb2.CHAT_FINISH_REASON_SCHEMA_MISMATCH)])
    body = _roundtrip(chat_response(chat, logprobs=False, **META))
    assert body["warnings"] == [warning]
    assert body["choices"][0]["finish_reason"] == "schema_mismatch"
    delta = chat_pb2.ChatStreamResponse(content="1", warnings=[warning])
    assert _roundtrip(chat_chunk(delta, first=True, **META))["warnings"] == [warning]


def test_completion_response() -> None:
    length, stop = common_pb2.FINISH_REASON_LENGTH, common_pb2.FINISH_REASON_STOP
    # Out of order, as samples of several prompts may finish.
    completions = [
        (3, generate_pb2.Completion(index=1, text="b", finish_reason=length)),
        (0, generate_pb2.Completion(index=0, text="a", finish_reason=stop)),
    ]
    body = _roundtrip(completion_response(completions, USAGE, logprobs=False, **META))
    assert body == {
        "id": "cmpl-1", "object": "text_completion", "created": 1700000000, "model": "tiny",
        "choices": [
            {"index": 0, "text": "a", "logprobs": None, "finish_reason": "stop",
             "stop_reason": None},
            {"index": 3, "text": "b", "logprobs": None, "finish_reason": "length",
             "stop_reason": None},
        ],
        "usage": USAGE_JSON,
    }
    parsed = openai.types.Completion.model_validate(body)
    assert parsed.usage is not None and parsed.usage.prompt_tokens_details is not None
    assert parsed.usage.prompt_tokens_details.cached_tokens == 2


def test_completion_logprobs() -> None:
    completion = generate_pb2.Completion(
        index=0, text="Hello world", finish_reason=common_pb2.FINISH_REASON_LENGTH,
        logprobs=[_position("Hello", -0.5, ("Hello", -0.5), ("Hi", -1.5)),
                  # The sampled token need not be among the alternatives.
                  _position(" world", -3.0, ("!", -0.25)),
                  _position("", -math.inf)])
    body = _roundtrip(completion_response([(0, completion)], USAGE, logprobs=True, **META))
    assert body["choices"][0]["logprobs"] == {
        "tokens": ["Hello", " world", ""],
        "token_logprobs": [-0.5, -3.0, -9999.0],
        "top_logprobs": [{"Hello": -0.5, "Hi": -1.5}, {"!": -0.25, " world": -3.0},
                         {"": -9999.0}],
        "text_offset": [0, 5, 11],
    }
    openai.types.Completion.model_validate(body)


def test_completion_prompt_logprobs() -> None:
    completion = generate_pb2.Completion(index=0, text="x",
                                         finish_reason=common_pb2.FINISH_REASON_LENGTH)
    positions = [_position(" b", -2.0, (" c", -0.5), token_id=9, rank=2)]
    body = _roundtrip(completion_response(
        [(0, completion), (1, completion)], USAGE, logprobs=False,
        prompt_logprobs={0: positions}, **META))
    assert body["choices"][0]["prompt_logprobs"] == [None, {
        "100": {"logprob": -0.5, "rank": 1, "decoded_token": " c"},
        "9": {"logprob": -2.0, "rank": 2, "decoded_token": " b"},
    }]
    assert body["choices"][1]["prompt_logprobs"] is None
    openai.types.Completion.model_validate(body)
    # Not asked for: no key at all.
    plain = completion_response([(0, completion)], USAGE, logprobs=False, **META)
    assert "prompt_logprobs" not in plain["choices"][0]


def test_completion_chunks() -> None:
    first = generate_pb2.GenerateStreamResponse(
        index=1, text="Hello", token_ids=[5], logprobs=[_position("Hello", -0.5)])
    last = generate_pb2.GenerateStreamResponse(
        index=1, text=" world", token_ids=[6, 7],
        logprobs=[_position(" wor", -1.0), _position("ld", -0.125)],
        finish_reason=common_pb2.FINISH_REASON_STOP_STRING, stop_string="\n")
    other = generate_pb2.GenerateStreamResponse(
        index=0, text="Hi", token_ids=[8], logprobs=[_position("Hi", -0.5)])
    stream = CompletionLogprobs()
    bodies = [_roundtrip(completion_chunk(chunk, index=index, logprobs=stream, **META))
              for index, chunk in ((3, first), (0, other), (3, last))]
    assert bodies[0] == {
        "id": "cmpl-1", "object": "text_completion", "created": 1700000000, "model": "tiny",
        "choices": [{"index": 3, "text": "Hello", "finish_reason": None, "stop_reason": None,
                     "logprobs": {"tokens": ["Hello"], "token_logprobs": [-0.5],
                                  "top_logprobs": [{"Hello": -0.5}], "text_offset": [0]}}],
    }
    # Each choice's offsets continue from its own previous chunk.
    assert bodies[1]["choices"][0]["logprobs"]["text_offset"] == [0]
    [choice] = bodies[2]["choices"]
    assert choice["logprobs"]["text_offset"] == [5, 9]
    assert (choice["finish_reason"], choice["stop_reason"]) == ("stop", "\n")
    # OpenAI types a finish_reason as required; streamed chunks are not validated by the
    # SDK, but the last one must pass.
    openai.types.Completion.model_validate(bodies[2])
    assert completion_chunk(first, index=0, logprobs=None, **META)["choices"][0][
        "logprobs"] is None
    # token_ids only where asked for (vLLM's return_token_ids).
    assert "token_ids" not in bodies[2]["choices"][0]
    with_ids = _roundtrip(completion_chunk(last, index=3, logprobs=None, token_ids=True,
                                           **META))
    assert with_ids["choices"][0]["token_ids"] == [6, 7]


def test_usage_chunks() -> None:
    for object_ in ("text_completion", "chat.completion.chunk"):
        body = _roundtrip(usage_chunk(USAGE, object=object_, **META))
        assert body == {"id": "cmpl-1", "object": object_, "created": 1700000000,
                        "model": "tiny", "choices": [], "usage": USAGE_JSON}
    openai.types.Completion.model_validate(
        usage_chunk(USAGE, object="text_completion", **META))
    openai.types.chat.ChatCompletionChunk.model_validate(
        usage_chunk(USAGE, object="chat.completion.chunk", **META))


def test_sum_usage() -> None:
    total = sum_usage([USAGE, common_pb2.Usage(prompt_tokens=1, completion_tokens=1)])
    assert (total.prompt_tokens, total.completion_tokens, total.cached_tokens) == (6, 4, 2)


def _chunk(first: bool = False, **fields: Any) -> dict[str, Any]:
    body = _roundtrip(chat_chunk(chat_pb2.ChatStreamResponse(**fields), first=first, **META))
    openai.types.chat.ChatCompletionChunk.model_validate(body)
    assert body["object"] == "chat.completion.chunk"
    [choice] = body["choices"]
    return choice


def test_chat_chunk_shapes() -> None:
    assert _chunk(first=True, index=0, content="Hi") == {
        "index": 0, "delta": {"role": "assistant", "content": "Hi"}, "logprobs": None,
        "finish_reason": None}
    # A first chunk without text still opens the answer, as OpenAI's does.
    assert _chunk(first=True, index=1)["delta"] == {"role": "assistant", "content": ""}
    assert _chunk(index=0, content=" there")["delta"] == {"content": " there"}
    assert _chunk(index=0, reasoning="hmm")["delta"] == {"reasoning_content": "hmm",
                                                         "reasoning": "hmm"}
    assert _chunk(index=0, finish_reason=chat_pb2.CHAT_FINISH_REASON_STOP) == {
        "index": 0, "delta": {}, "logprobs": None, "finish_reason": "stop"}


def test_chat_chunk_tool_calls() -> None:
    opening = _chunk(first=True, index=0, tool_calls=[
        chat_pb2.ToolCallDelta(index=0, id="call_1", name="get", arguments="")])
    assert opening["delta"] == {"role": "assistant", "tool_calls": [
        {"index": 0, "id": "call_1", "type": "function",
         "function": {"name": "get", "arguments": ""}}]}
    fragment = _chunk(index=0, tool_calls=[
        chat_pb2.ToolCallDelta(index=0, arguments="{\"city\": "),
        chat_pb2.ToolCallDelta(index=1, id="call_2", name="put", arguments="{}")])
    assert fragment["delta"] == {"tool_calls": [
        {"index": 0, "function": {"arguments": "{\"city\": "}},
        {"index": 1, "id": "call_2", "type": "function",
         "function": {"name": "put", "arguments": "{}"}}]}
    ending = _chunk(index=0, finish_reason=chat_pb2.CHAT_FINISH_REASON_TOOL_CALLS)
    assert ending["finish_reason"] == "tool_calls"


def test_chat_chunk_logprobs() -> None:
    choice = _chunk(index=0, content="é", logprobs=[_position("é", -0.25, ("é", -0.25),
                                                              ("e", -2.0))])
    assert choice["logprobs"] == {"content": [
        {"token": "é", "logprob": -0.25, "bytes": [0xC3, 0xA9],
         "top_logprobs": [{"token": "é", "logprob": -0.25, "bytes": [0xC3, 0xA9]},
                          {"token": "e", "logprob": -2.0, "bytes": [0x65]}]}]}


def test_chat_response() -> None:
    response = chat_pb2.ChatResponse(
        choices=[
            chat_pb2.ChatChoice(index=1, content="", reasoning="need weather",
                                tool_calls=[chat_pb2.ToolCall(id="call_1", name="get",
                                                              arguments="{\"city\":\"Oslo\"}")],
                                finish_reason=chat_pb2.CHAT_FINISH_REASON_TOOL_CALLS),
            chat_pb2.ChatChoice(index=0, content="It is 12C.",
                                finish_reason=chat_pb2.CHAT_FINISH_REASON_STOP),
        ],
        usage=USAGE)
    body = _roundtrip(chat_response(response, logprobs=False, **META))
    assert body == {
        "id": "cmpl-1", "object": "chat.completion", "created": 1700000000, "model": "tiny",
        "choices": [
            {"index": 0, "message": {"role": "assistant", "content": "It is 12C.",
                                     "refusal": None, "reasoning_content": None,
                                     "reasoning": None},
             "logprobs": None, "finish_reason": "stop", "stop_reason": None},
            {"index": 1, "message": {"role": "assistant", "content": None, "refusal": None,
                                     "reasoning_content": "need weather",
                                     "reasoning": "need weather",
                                     "tool_calls": [{"id": "call_1", "type": "function",
                                                     "function": {"name": "get",
                                                                  "arguments":
                                                                      "{\"city\":\"Oslo\"}"}}]},
             "logprobs": None, "finish_reason": "tool_calls", "stop_reason": None},
        ],
        "usage": USAGE_JSON,
    }
    parsed = openai.types.chat.ChatCompletion.model_validate(body)
    assert parsed.choices[1].message.tool_calls is not None
    assert parsed.choices[1].message.tool_calls[0].function.name == "get"  # type: ignore[union-attr]


def test_chat_response_empty_answer_keeps_its_content() -> None:
    response = chat_pb2.ChatResponse(
        choices=[chat_pb2.ChatChoice(finish_reason=chat_pb2.CHAT_FINISH_REASON_LENGTH)])
    [choice] = chat_response(response, logprobs=False, **META)["choices"]
    assert choice["message"]["content"] == ""


def test_chat_logprobs_bytes_of_part_of_a_character_are_the_real_ones() -> None:
    position = _position("\ufffd", -0.5, ("\ufffd", -0.5))
    position.token_bytes = position.top[0].token_bytes = b"\xe2\x80"
    choice = _chunk(index=0, content="", logprobs=[position])
    [entry] = choice["logprobs"]["content"]
    assert entry["bytes"] == entry["top_logprobs"][0]["bytes"] == [0xE2, 0x80]


def test_chat_response_logprobs() -> None:
    response = chat_pb2.ChatResponse(choices=[chat_pb2.ChatChoice(
        content="ok", finish_reason=chat_pb2.CHAT_FINISH_REASON_STOP,
        logprobs=[_position("ok", -0.5)])])
    body = _roundtrip(chat_response(response, logprobs=True, **META))
    assert body["choices"][0]["logprobs"] == {"content": [
        {"token": "ok", "logprob": -0.5, "bytes": [0x6F, 0x6B], "top_logprobs": []}]}
    openai.types.chat.ChatCompletion.model_validate(body)


def test_models_list() -> None:
    body = _roundtrip(models_list("tiny", 1700000000, 4096))
    assert body == {"object": "list", "data": [
        {"id": "tiny", "object": "model", "created": 1700000000, "owned_by": "corestream",
         "root": "tiny", "parent": None, "max_model_len": 4096, "tasks": ["generate"]}]}
    model = openai.types.Model.model_validate(body["data"][0])
    assert model.model_extra == {"root": "tiny", "parent": None, "max_model_len": 4096,
                                 "tasks": ["generate"]}
    served = models_list("alias", 1700000000, 4096, root="/models/tiny")["data"][0]
    assert (served["id"], served["root"], served["parent"]) == ("alias", "/models/tiny", None)
    pooling = models_list("st", 1700000000, 512, ("embed", "score"))
    assert pooling["data"][0]["tasks"] == ["embed", "score"]


def test_error_body() -> None:
    assert error_body("bad n", "BadRequestError", "n", 400) == {
        "error": {"message": "bad n", "type": "BadRequestError", "param": "n", "code": 400}}
    assert error_body("gone", "NotFoundError") == {
        "error": {"message": "gone", "type": "NotFoundError", "param": None, "code": None}}
