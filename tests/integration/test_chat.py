"""ChatService through the real cluster (`corestream serve` on the built-in tiny
random-weight model and its own chat template, hermes tool calls), checked with
independent validators: our tool parser is not trusted to judge itself, the calls
are re-read from the raw answer with json and validated with jsonschema.

The random weights never write a tool call by themselves, so every call here is
`tool_choice` enforced by the output constraint. One cluster serves the module.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from typing import Any

import grpc
import jsonschema
import pytest
from corestream.common.v1 import common_pb2
from corestream.generate.v1 import chat_service_pb2 as chat_pb2
from corestream.generate.v1 import chat_service_pb2_grpc as chat_grpc
from corestream.generate.v1 import generate_service_pb2 as pb
from corestream.generate.v1 import generate_service_pb2_grpc as pb_grpc
from tokenizers import Tokenizer

from services.common.tiny_checkpoint import ensure_tiny_checkpoint
from services.frontend.chat.constraints import (
    FunctionSpec,
    added_token_ids,
    tool_call_constraint,
    with_reasoning_prefix,
)
from tests.integration.cluster import Cluster

TIMEOUT_S = 240
MAX_TOKENS = 200
WEATHER_SCHEMA = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 8},
                   "unit": {"enum": ["celsius", "fahrenheit"]}},
    "required": ["city", "unit"],
    "additionalProperties": False,
}
TIME_SCHEMA = {"type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}},
               "required": ["zone"], "additionalProperties": False}
SCHEMAS = {"get_weather": WEATHER_SCHEMA, "get_time": TIME_SCHEMA}
TOOLS = [chat_pb2.Tool(name=name, description=f"{name} tool", parameters=json.dumps(schema))
         for name, schema in SCHEMAS.items()]
MESSAGES = [chat_pb2.ChatMessage(role="system", content="You answer with tools."),
            chat_pb2.ChatMessage(role="user", content="What is the weather in Paris?")]
REQUIRED = chat_pb2.ToolChoice(mode=chat_pb2.TOOL_CHOICE_MODE_REQUIRED)
CALL = re.compile(r"<tool_call>\n(.*?)\n</tool_call>", re.DOTALL)


@pytest.fixture(scope="module")
def cluster() -> Iterator[Cluster]:
    c = Cluster(["--engines", "1", "--reasoning-parser", "qwen3"])
    yield c
    c.stop()


@pytest.fixture(scope="module")
def channel(cluster: Cluster) -> Iterator[grpc.Channel]:
    with grpc.insecure_channel(cluster.address) as channel:
        yield channel


@pytest.fixture(scope="module")
def chat(channel: grpc.Channel) -> chat_grpc.ChatServiceStub:
    return chat_grpc.ChatServiceStub(channel)


def _sampling(seed: int | None) -> common_pb2.SamplingParams:
    if seed is None:
        return common_pb2.SamplingParams(temperature=0, max_tokens=MAX_TOKENS)
    return common_pb2.SamplingParams(temperature=1, seed=seed, max_tokens=MAX_TOKENS)


def _streamed_calls(responses: list[chat_pb2.ChatStreamResponse]) -> list[dict[str, Any]]:
    """The calls as a client assembles them from the deltas."""
    calls: dict[int, dict[str, Any]] = {}
    for response in responses:
        for delta in response.tool_calls:
            call = calls.setdefault(delta.index, {"id": "", "name": "", "arguments": ""})
            if delta.id:
                assert not call["id"], "a call's id comes once"
                call["id"], call["name"] = delta.id, delta.name
            call["arguments"] += delta.arguments
    return [calls[i] for i in sorted(calls)]


def _tool_grammar() -> str:
    """The grammar the frontend sends for REQUIRED with TOOLS on the tiny model (whose
    prompt opens no think block, so reasoning is optional before the calls)."""
    tokenizer = Tokenizer.from_file(str(ensure_tiny_checkpoint() / "tokenizer.json"))
    added = added_token_ids(tokenizer)
    functions = [FunctionSpec(name, schema) for name, schema in SCHEMAS.items()]
    calls = tool_call_constraint("hermes", functions, parallel=True, special_tokens=added)
    return with_reasoning_prefix(calls, opened=False, required=False,
                                 special_tokens=added).spec


def _check_call(call: dict[str, Any], names: set[str]) -> None:
    assert call["id"] and call["name"] in names, call
    jsonschema.validate(json.loads(call["arguments"]), SCHEMAS[call["name"]])


@pytest.mark.timeout(TIMEOUT_S)
@pytest.mark.parametrize("seed", [None, 1, 2, 3])
def test_required_tool_choice_streams_one_valid_call(
    chat: chat_grpc.ChatServiceStub, seed: int | None
) -> None:
    responses = list(chat.ChatStream(chat_pb2.ChatStreamRequest(
        messages=MESSAGES, tools=TOOLS, tool_choice=REQUIRED, parallel_tool_calls=False,
        sampling=_sampling(seed))))
    [call] = _streamed_calls(responses)
    _check_call(call, set(SCHEMAS))
    assert "".join(r.content for r in responses) == ""
    assert "".join(r.reasoning for r in responses) == ""
    assert responses[-1].finish_reason == chat_pb2.CHAT_FINISH_REASON_TOOL_CALLS
    assert responses[-1].usage.completion_tokens > 0


@pytest.mark.timeout(TIMEOUT_S)
def test_named_function_is_the_one_called(chat: chat_grpc.ChatServiceStub) -> None:
    for seed in (4, 5):
        response = chat.Chat(chat_pb2.ChatRequest(
            messages=MESSAGES, tools=TOOLS, tool_choice=chat_pb2.ToolChoice(function="get_time"),
            sampling=_sampling(seed)))  # parallel calls at their default: still one
        [choice] = response.choices
        [call] = choice.tool_calls
        _check_call({"id": call.id, "name": call.name, "arguments": call.arguments},
                    {"get_time"})
        assert choice.finish_reason == chat_pb2.CHAT_FINISH_REASON_TOOL_CALLS


@pytest.mark.timeout(TIMEOUT_S)
def test_parallel_calls_are_each_valid(chat: chat_grpc.ChatServiceStub,
                                       channel: grpc.Channel) -> None:
    request = chat_pb2.ChatRequest(messages=MESSAGES, tools=TOOLS, tool_choice=REQUIRED,
                                   sampling=_sampling(6))
    response = chat.Chat(request)
    [choice] = response.choices
    assert choice.tool_calls
    for call in choice.tool_calls:
        _check_call({"id": call.id, "name": call.name, "arguments": call.arguments},
                    set(SCHEMAS))
    # Cut by max_tokens inside a further call, that call is dropped: never content.
    assert choice.finish_reason in (chat_pb2.CHAT_FINISH_REASON_TOOL_CALLS,
                                    chat_pb2.CHAT_FINISH_REASON_LENGTH)
    assert choice.content == ""
    # Independently of our parser: the same prompt, grammar and seed through Generate
    # give the same tokens, and their raw text is read here with a regex and json.
    rendered = chat.RenderChat(chat_pb2.RenderChatRequest(messages=MESSAGES, tools=TOOLS))
    sampling = _sampling(6)
    sampling.grammar = _tool_grammar()
    raw = pb_grpc.GenerateServiceStub(channel).Generate(pb.GenerateRequest(
        token_ids=pb.TokenIds(ids=rendered.token_ids), sampling=sampling,
        skip_special_tokens=False))
    calls = [json.loads(body) for body in CALL.findall(raw.completions[0].text)]
    assert [(c["name"], c["arguments"]) for c in calls] == [
        (call.name, json.loads(call.arguments)) for call in choice.tool_calls]


@pytest.mark.timeout(TIMEOUT_S)
def test_response_format_json_schema_gives_valid_content(
    chat: chat_grpc.ChatServiceStub,
) -> None:
    response = chat.Chat(chat_pb2.ChatRequest(
        messages=MESSAGES, sampling=_sampling(7),
        response_format=chat_pb2.ResponseFormat(type=chat_pb2.RESPONSE_FORMAT_TYPE_JSON_SCHEMA,
                                                json_schema=json.dumps(WEATHER_SCHEMA))))
    [choice] = response.choices
    jsonschema.validate(json.loads(choice.content), WEATHER_SCHEMA)
    assert choice.finish_reason == chat_pb2.CHAT_FINISH_REASON_STOP


@pytest.mark.timeout(TIMEOUT_S)
def test_reasoning_opened_by_the_prompt_is_reasoning(chat: chat_grpc.ChatServiceStub) -> None:
    # The assistant turn continues inside an open <think>: what the model writes is
    # reasoning (it never closes the block in 16 tokens of random weights).
    thinking = chat.Chat(chat_pb2.ChatRequest(
        messages=[*MESSAGES, chat_pb2.ChatMessage(role="assistant", content="<think>\nLet")],
        continue_final_message=True,
        sampling=common_pb2.SamplingParams(temperature=0, max_tokens=16)))
    plain = chat.Chat(chat_pb2.ChatRequest(
        messages=MESSAGES, sampling=common_pb2.SamplingParams(temperature=0, max_tokens=16)))
    [reasoning], [content] = thinking.choices, plain.choices
    assert reasoning.reasoning and not reasoning.content
    assert content.content and not content.reasoning
    assert reasoning.finish_reason == content.finish_reason == chat_pb2.CHAT_FINISH_REASON_LENGTH


@pytest.mark.timeout(TIMEOUT_S)
def test_bad_conversations_get_invalid_argument(chat: chat_grpc.ChatServiceStub) -> None:
    bad = [
        chat_pb2.ChatRequest(messages=[chat_pb2.ChatMessage(role="wizard", content="x")]),
        chat_pb2.ChatRequest(messages=MESSAGES, tools=TOOLS,
                             tool_choice=chat_pb2.ToolChoice(function="get_stock")),
        chat_pb2.ChatRequest(messages=MESSAGES, chat_template="{{ messages }}"),
        # The template refuses a continuation of a turn that is not the assistant's.
        chat_pb2.ChatRequest(messages=MESSAGES, continue_final_message=True),
    ]
    for request in bad:
        with pytest.raises(grpc.RpcError) as info:
            chat.Chat(request)
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT, info.value.details()
    assert chat.Chat(chat_pb2.ChatRequest(messages=MESSAGES, sampling=_sampling(None)))
