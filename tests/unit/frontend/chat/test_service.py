"""ChatService in-process against a scripted engine on 127.0.0.1.

The engine "generates" a scripted answer token by token, so these tests pin down
what the chat layer makes of it: the rendered prompt the engine receives, the
reasoning / content / tool-call split of streamed and whole answers, finish
reasons, the constraints that tool_choice and response_format send to the
engine, and the errors for bad conversations.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable
from typing import Any

import grpc
import pytest
from corestream.common.v1 import common_pb2
from corestream.generate.v1 import chat_service_pb2 as chat_pb2
from corestream.generate.v1 import chat_service_pb2_grpc as chat_grpc
from google.protobuf import struct_pb2
from google.rpc import error_details_pb2
from grpc_status import rpc_status

from services.common.tiny_checkpoint import TINY_CHAT_TEMPLATE
from services.frontend.chat.template import ChatTemplates, render_chat
from services.frontend.config import FrontendConfig
from services.frontend.server import FrontendServer
from tests.unit.frontend.fakes import CALL_TEXT, FakeEngine, start_fake_engine
from tests.unit.frontend.fakes import CHAT_EOS_ID as EOS_ID
from tests.unit.frontend.fakes import CHAT_MODEL as MODEL
from tests.unit.frontend.fakes import CHAT_SPECIAL as SPECIAL
from tests.unit.frontend.fakes import CHAT_TOKENIZER as TOKENIZER

WEATHER = chat_pb2.Tool(
    name="get_weather", description="Current weather in a city.",
    parameters=json.dumps({"type": "object", "properties": {
        "city": {"type": "string", "maxLength": 12},
        "unit": {"enum": ["c", "f"]}}, "required": ["city"]}),
)
TIME = chat_pb2.Tool(name="get_time", parameters="")
QUESTION = [chat_pb2.ChatMessage(role="system", content="Be brief."),
            chat_pb2.ChatMessage(role="user", content="Weather in Paris?")]
# A template that refuses a conversation, as real ones do for unsupported roles.
REFUSING_TEMPLATE = ("{% if messages[0].role == 'user' %}{{ raise_exception('Conversations "
                     "must start with a system message') }}{% endif %}ok")


Body = Callable[[chat_grpc.ChatServiceStub], Awaitable[None]]


def _serve(answer: str | None, body: Body, *, eos: bool = True,
           templates: ChatTemplates | None = None, engine: FakeEngine | None = None,
           **config: Any) -> FakeEngine:
    script = TOKENIZER.encode(answer or "", add_special_tokens=False) + ([EOS_ID] if eos else [])
    engine = engine or FakeEngine(script, step_s=0.001)
    if templates is None:
        templates = ChatTemplates(default=TINY_CHAT_TEMPLATE, special_tokens=SPECIAL)

    async def main() -> None:
        engine_server, address = await start_fake_engine(engine)
        frontend = FrontendServer(FrontendConfig(port=0, engines=(address,), **config),
                                  TOKENIZER, MODEL, chat_templates=templates)
        port = await frontend.start()
        try:
            async with asyncio.timeout(10):
                while not frontend.balancer.ready:
                    await asyncio.sleep(0.01)
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
                await body(chat_grpc.ChatServiceStub(channel))
        finally:
            await frontend.stop(0)
            await engine_server.stop(0)

    asyncio.run(main())
    return engine


async def _stream(stub: chat_grpc.ChatServiceStub,
                  **fields: Any) -> list[chat_pb2.ChatStreamResponse]:
    return [r async for r in stub.ChatStream(chat_pb2.ChatStreamRequest(**fields))]


def _joined(responses: list[chat_pb2.ChatStreamResponse], name: str) -> str:
    return "".join(getattr(r, name) for r in responses)


@pytest.mark.timeout(30)
def test_render_chat_gives_the_templates_text_and_ids_without_a_second_bos() -> None:
    async def body(stub: chat_grpc.ChatServiceStub) -> None:
        response = await stub.RenderChat(chat_pb2.RenderChatRequest(
            messages=QUESTION, tools=[WEATHER]))
        expected = render_chat(
            TINY_CHAT_TEMPLATE,
            [{"role": "system", "content": "Be brief."},
             {"role": "user", "content": "Weather in Paris?"}],
            tools=[{"type": "function", "function": {
                "name": "get_weather", "description": "Current weather in a city.",
                "parameters": json.loads(WEATHER.parameters)}}],
            add_generation_prompt=True, continue_final_message=False, template_kwargs={},
            special_tokens=SPECIAL)
        assert response.prompt == expected
        assert list(response.token_ids) == TOKENIZER.encode(expected, add_special_tokens=False)
        assert list(response.token_ids).count(1) == 1  # the template's own <s> only

        continued = await stub.RenderChat(chat_pb2.RenderChatRequest(
            messages=[*QUESTION, chat_pb2.ChatMessage(role="assistant", content="It is")],
            continue_final_message=True))
        assert continued.prompt.endswith("<|assistant|>\nIt is")

    _serve(None, body)


@pytest.mark.timeout(30)
def test_stream_splits_content_and_a_tool_call() -> None:
    async def body(stub: chat_grpc.ChatServiceStub) -> None:
        responses = await _stream(stub, messages=QUESTION, tools=[WEATHER, TIME])
        assert _joined(responses, "content") == "Let me check."
        # The whole call in one delta: OpenAI's first delta of a call (id, name and
        # arguments), and no second.
        [delta] = [d for r in responses for d in r.tool_calls]
        assert (delta.index, delta.name) == (0, "get_weather") and delta.id
        assert json.loads(delta.arguments) == {"city": "Paris"}
        assert responses[-1].finish_reason == chat_pb2.CHAT_FINISH_REASON_TOOL_CALLS
        assert responses[-1].usage.completion_tokens > 0
        assert "</s>" not in _joined(responses, "content")

    engine = _serve(f"Let me check.\n{CALL_TEXT}", body)
    # The engine got the rendered prompt, tokenized without adding special tokens.
    prompt = TOKENIZER.decode(list(engine.adds[0].prompt_token_ids), skip_special_tokens=False)
    assert prompt.startswith("<s><|system|>\nBe brief.") and prompt.count("<s>") == 1
    assert not engine.adds[0].sampling.HasField("grammar")


@pytest.mark.timeout(30)
def test_unary_chat_separates_reasoning_from_content() -> None:
    async def body(stub: chat_grpc.ChatServiceStub) -> None:
        response = await stub.Chat(chat_pb2.ChatRequest(messages=QUESTION, request_id="r1"))
        assert response.request_id == "r1"
        [choice] = response.choices
        assert choice.reasoning == "I think about it."
        assert choice.content == "Hello there!"
        assert not choice.tool_calls
        assert choice.finish_reason == chat_pb2.CHAT_FINISH_REASON_STOP
        assert response.usage.prompt_tokens > 0

    _serve("<think>\nI think about it.\n</think>\n\nHello there!", body,
           reasoning_parser="qwen3")


@pytest.mark.timeout(30)
def test_unary_chat_returns_whole_tool_calls() -> None:
    async def body(stub: chat_grpc.ChatServiceStub) -> None:
        response = await stub.Chat(chat_pb2.ChatRequest(messages=QUESTION, tools=[WEATHER]))
        [choice] = response.choices
        assert choice.content == ""
        [call] = choice.tool_calls
        assert (call.name, json.loads(call.arguments)) == ("get_weather", {"city": "Paris"})
        assert choice.finish_reason == chat_pb2.CHAT_FINISH_REASON_TOOL_CALLS

    _serve(CALL_TEXT, body)


@pytest.mark.timeout(30)
def test_a_call_cut_by_max_tokens_is_dropped_and_the_calls_before_it_kept() -> None:
    two_calls = f"{CALL_TEXT}\n{CALL_TEXT}"
    whole = len(TOKENIZER.encode(two_calls, add_special_tokens=False))
    one = len(TOKENIZER.encode(CALL_TEXT, add_special_tokens=False))

    async def body(stub: chat_grpc.ChatServiceStub) -> None:
        # Cut inside the first call, just after the second's marker, inside the second.
        for max_tokens, calls in ((6, 0), (one + 2, 1), (whole - 3, 1)):
            sampling = common_pb2.SamplingParams(max_tokens=max_tokens)
            responses = await _stream(stub, messages=QUESTION, tools=[WEATHER],
                                      sampling=sampling)
            assert len([d for r in responses for d in r.tool_calls]) == calls
            assert _joined(responses, "content") == ""
            assert responses[-1].finish_reason == chat_pb2.CHAT_FINISH_REASON_LENGTH
            response = await stub.Chat(chat_pb2.ChatRequest(messages=QUESTION, tools=[WEATHER],
                                                            sampling=sampling))
            [choice] = response.choices
            assert (choice.content, len(choice.tool_calls)) == ("", calls)
            assert choice.finish_reason == chat_pb2.CHAT_FINISH_REASON_LENGTH

    _serve(two_calls, body)


@pytest.mark.timeout(30)
def test_parallel_tool_calls_false_reports_only_the_first_call() -> None:
    async def body(stub: chat_grpc.ChatServiceStub) -> None:
        responses = await _stream(stub, messages=QUESTION, tools=[WEATHER],
                                  parallel_tool_calls=False)
        assert [d.index for r in responses for d in r.tool_calls] == [0]
        assert _joined(responses, "content") == ""
        response = await stub.Chat(chat_pb2.ChatRequest(messages=QUESTION, tools=[WEATHER],
                                                        parallel_tool_calls=False))
        assert len(response.choices[0].tool_calls) == 1
        assert response.choices[0].finish_reason == chat_pb2.CHAT_FINISH_REASON_TOOL_CALLS
        both = await stub.Chat(chat_pb2.ChatRequest(messages=QUESTION, tools=[WEATHER]))
        assert len(both.choices[0].tool_calls) == 2

    _serve(f"{CALL_TEXT}\n{CALL_TEXT}", body)


@pytest.mark.timeout(30)
def test_tool_choice_none_and_no_tools_leave_calls_as_content() -> None:
    async def body(stub: chat_grpc.ChatServiceStub) -> None:
        none = chat_pb2.ToolChoice(mode=chat_pb2.TOOL_CHOICE_MODE_NONE)
        for fields in ({"tools": [WEATHER], "tool_choice": none}, {}):
            response = await stub.Chat(chat_pb2.ChatRequest(messages=QUESTION, **fields))
            assert response.choices[0].content == CALL_TEXT
            assert response.choices[0].finish_reason == chat_pb2.CHAT_FINISH_REASON_STOP

    _serve(CALL_TEXT, body)


@pytest.mark.timeout(30)
def test_required_and_named_tool_choice_send_a_grammar_to_the_engine() -> None:
    async def body(stub: chat_grpc.ChatServiceStub) -> None:
        required = chat_pb2.ToolChoice(mode=chat_pb2.TOOL_CHOICE_MODE_REQUIRED)
        await stub.Chat(chat_pb2.ChatRequest(messages=QUESTION, tools=[WEATHER, TIME],
                                             tool_choice=required))
        await stub.Chat(chat_pb2.ChatRequest(
            messages=QUESTION, tools=[WEATHER, TIME],
            tool_choice=chat_pb2.ToolChoice(function="get_time")))

        await stub.Chat(chat_pb2.ChatRequest(messages=QUESTION, tools=[WEATHER, TIME],
                                             tool_choice=required, parallel_tool_calls=False))

    engine = _serve(CALL_TEXT, body)
    both, named, single = (add.sampling.grammar for add in engine.adds)
    assert "get_weather" in both and "get_time" in both
    assert "get_time" in named and "get_weather" not in named
    # `required` takes a list of calls by default; a named function (whatever
    # parallel_tool_calls says) and parallel_tool_calls=false take exactly one.
    assert "call)*" in both
    assert "call)*" not in named and "call)*" not in single


@pytest.mark.timeout(30)
def test_response_format_becomes_the_engines_constraint() -> None:
    schema = json.dumps({"type": "object", "properties": {"a": {"type": "integer"}}})

    async def body(stub: chat_grpc.ChatServiceStub) -> None:
        for response_format in (
            chat_pb2.ResponseFormat(type=chat_pb2.RESPONSE_FORMAT_TYPE_JSON_SCHEMA,
                                    json_schema=schema),
            chat_pb2.ResponseFormat(type=chat_pb2.RESPONSE_FORMAT_TYPE_JSON_OBJECT),
            chat_pb2.ResponseFormat(type=chat_pb2.RESPONSE_FORMAT_TYPE_TEXT),
        ):
            await stub.Chat(chat_pb2.ChatRequest(messages=QUESTION,
                                                 response_format=response_format))

    engine = _serve('{"a": 1}', body)
    schema_add, object_add, text_add = engine.adds
    assert schema_add.sampling.json_schema == schema
    assert object_add.sampling.json_object
    assert text_add.sampling.WhichOneof("constraint") is None


NOT_A = json.dumps({"type": "object", "properties": {"a": {"type": "integer",
                                                          "not": {"const": 1}}}})


@pytest.mark.timeout(30)
def test_a_schema_the_grammar_approximates_is_checked_when_the_answer_ends() -> None:
    response_format = chat_pb2.ResponseFormat(
        type=chat_pb2.RESPONSE_FORMAT_TYPE_JSON_SCHEMA, json_schema=NOT_A)

    async def body(stub: chat_grpc.ChatServiceStub) -> None:
        response = await stub.Chat(chat_pb2.ChatRequest(messages=QUESTION,
                                                        response_format=response_format))
        [choice] = response.choices
        assert choice.content == '{"a": 1}'
        assert choice.finish_reason == chat_pb2.CHAT_FINISH_REASON_SCHEMA_MISMATCH
        [warning] = response.warnings
        assert warning.startswith("not at /properties/a/not is not enforced")
        streamed = await _stream(stub, messages=QUESTION, response_format=response_format)
        assert list(streamed[0].warnings) == [warning]
        assert not any(r.warnings for r in streamed[1:])
        assert streamed[-1].finish_reason == chat_pb2.CHAT_FINISH_REASON_SCHEMA_MISMATCH

    engine = _serve('{"a": 1}', body)
    # The engine follows the schema without the keyword it cannot enforce.
    assert "not" not in json.loads(engine.adds[0].sampling.json_schema)["properties"]["a"]


@pytest.mark.timeout(30)
def test_an_approximated_schema_is_refused_after_reasoning() -> None:
    async def body(stub: chat_grpc.ChatServiceStub) -> None:
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await stub.Chat(chat_pb2.ChatRequest(
                messages=QUESTION, response_format=chat_pb2.ResponseFormat(
                    type=chat_pb2.RESPONSE_FORMAT_TYPE_JSON_SCHEMA, json_schema=NOT_A)))
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "response_format.json_schema" in (info.value.details() or "")
        assert "/properties/a/not" in (info.value.details() or "")

    _serve('{"a": 2}', body, reasoning_parser="qwen3")


@pytest.mark.timeout(30)
def test_chat_template_kwargs_reach_the_template() -> None:
    template = "{{ greeting }}{% for m in messages %}{{ m.content }}{% endfor %}"
    kwargs = struct_pb2.Struct()
    kwargs.update({"greeting": "Hi! "})

    async def body(stub: chat_grpc.ChatServiceStub) -> None:
        response = await stub.RenderChat(chat_pb2.RenderChatRequest(
            messages=QUESTION, chat_template_kwargs=kwargs))
        assert response.prompt == "Hi! Be brief.Weather in Paris?"

    _serve(None, body, templates=ChatTemplates(default=template))


@pytest.mark.timeout(30)
def test_chat_template_kwargs_whole_numbers_print_as_ints() -> None:
    """Struct numbers are doubles; a template must still print 1024, not 1024.0."""
    template = "{{ budget }} {{ ratio }} {{ nested.n[0] }} {{ flag }}"
    kwargs = struct_pb2.Struct()
    kwargs.update({"budget": 1024, "ratio": 0.5, "nested": {"n": [3, "a"]}, "flag": True})

    async def body(stub: chat_grpc.ChatServiceStub) -> None:
        response = await stub.RenderChat(chat_pb2.RenderChatRequest(
            messages=QUESTION, chat_template_kwargs=kwargs))
        assert response.prompt == "1024 0.5 3 True"

    _serve(None, body, templates=ChatTemplates(default=template))


async def _status(call: Awaitable[Any]) -> tuple[grpc.StatusCode, str, list[str]]:
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await call
    error = info.value
    fields: list[str] = []
    status = rpc_status.from_call(error)
    for detail in status.details if status else ():
        bad = error_details_pb2.BadRequest()
        if detail.Unpack(bad):
            fields += [v.field for v in bad.field_violations]
    return error.code(), error.details() or "", fields


BAD_REQUESTS: list[tuple[dict[str, Any], str, str]] = [
    ({"messages": []}, "messages", "empty"),
    ({"messages": [chat_pb2.ChatMessage(role="robot", content="x")]}, "messages[0].role",
     "robot"),
    ({"messages": [chat_pb2.ChatMessage(role="user", content="x", content_parts=[
        chat_pb2.ContentPart(type="text", text="y")])]}, "messages[0].content_parts", "both"),
    ({"messages": [chat_pb2.ChatMessage(role="user", content_parts=[
        chat_pb2.ContentPart(type="image_url", text="y")])]},
     "messages[0].content_parts[0].type", "image_url"),
    ({"messages": [chat_pb2.ChatMessage(role="assistant", tool_calls=[
        chat_pb2.ToolCall(id="1", name="f", arguments="[1]")])]},
     "messages[0].tool_calls[0].arguments", "JSON object"),
    ({"messages": [chat_pb2.ChatMessage(role="user", tool_calls=[
        chat_pb2.ToolCall(name="f")])]}, "messages[0].tool_calls", "assistant"),
    ({"messages": QUESTION, "tools": [chat_pb2.Tool(name="bad name")]}, "tools[0].name",
     "bad name"),
    ({"messages": QUESTION, "tools": [WEATHER, WEATHER]}, "tools[1].name", "twice"),
    ({"messages": QUESTION, "tools": [chat_pb2.Tool(name="f", parameters="{")]},
     "tools[0].parameters", "not valid JSON"),
    ({"messages": QUESTION, "tools": [WEATHER],
      "tool_choice": chat_pb2.ToolChoice(function="nope")}, "tool_choice.function", "nope"),
    ({"messages": QUESTION,
      "tool_choice": chat_pb2.ToolChoice(mode=chat_pb2.TOOL_CHOICE_MODE_REQUIRED)},
     "tool_choice", "no tools"),
    ({"messages": QUESTION, "sampling": common_pb2.SamplingParams(regex="a+")},
     "sampling.regex", "response_format"),
    ({"messages": QUESTION, "response_format": chat_pb2.ResponseFormat(
        type=chat_pb2.RESPONSE_FORMAT_TYPE_JSON_SCHEMA, json_schema='{"type": "nope"}')},
     "response_format.json_schema", "nope"),
    ({"messages": QUESTION, "continue_final_message": True}, "continue_final_message",
     "assistant"),
    ({"messages": QUESTION, "chat_template": "{{ 1 }}"}, "chat_template",
     "--trust-request-chat-template"),
    ({"messages": QUESTION, "sampling": common_pb2.SamplingParams(temperature=-1)},
     "sampling.temperature", "temperature"),
    ({"messages": [chat_pb2.ChatMessage(role="user", content="x" * 5000)]}, "messages",
     "--max-chat-chars"),
    ({"messages": [chat_pb2.ChatMessage(role="user", content="x")] * 9}, "messages",
     "--max-chat-messages"),
]


@pytest.mark.timeout(60)
def test_bad_requests_get_invalid_argument_naming_the_field() -> None:
    async def body(stub: chat_grpc.ChatServiceStub) -> None:
        for fields, field, words in BAD_REQUESTS:
            for call in (stub.Chat(chat_pb2.ChatRequest(**fields)),
                         _stream(stub, **fields)):
                code, message, violations = await _status(call)
                assert code == grpc.StatusCode.INVALID_ARGUMENT, (fields, message)
                assert field in violations, (field, violations, message)
                assert words in message, (words, message)
        # The server still answers.
        response = await stub.Chat(chat_pb2.ChatRequest(messages=QUESTION))
        assert response.choices[0].content == "fine"

    _serve("fine", body, max_chat_chars=4096, max_chat_messages=8)


@pytest.mark.timeout(30)
def test_template_errors_and_request_templates() -> None:
    async def body(stub: chat_grpc.ChatServiceStub) -> None:
        user_only = [chat_pb2.ChatMessage(role="user", content="hi")]
        code, message, _ = await _status(stub.Chat(chat_pb2.ChatRequest(
            messages=user_only, chat_template=REFUSING_TEMPLATE)))
        assert code == grpc.StatusCode.INVALID_ARGUMENT
        assert "Conversations must start with a system message" in message
        code, message, _ = await _status(stub.RenderChat(chat_pb2.RenderChatRequest(
            messages=user_only, chat_template="{% for %}")))
        assert code == grpc.StatusCode.INVALID_ARGUMENT and "chat template" in message
        rendered = await stub.RenderChat(chat_pb2.RenderChatRequest(
            messages=QUESTION, chat_template=REFUSING_TEMPLATE))
        assert rendered.prompt == "ok"

    _serve(None, body, trust_request_chat_template=True)


@pytest.mark.timeout(30)
def test_a_model_without_a_template_gets_failed_precondition() -> None:
    async def body(stub: chat_grpc.ChatServiceStub) -> None:
        for call in (stub.Chat(chat_pb2.ChatRequest(messages=QUESTION)),
                     stub.RenderChat(chat_pb2.RenderChatRequest(messages=QUESTION))):
            code, message, _ = await _status(call)
            assert code == grpc.StatusCode.FAILED_PRECONDITION
            assert "--chat-template" in message

    _serve(None, body, templates=ChatTemplates(default=None))


@pytest.mark.timeout(30)
def test_each_sample_is_parsed_on_its_own() -> None:
    async def body(stub: chat_grpc.ChatServiceStub) -> None:
        response = await stub.Chat(chat_pb2.ChatRequest(
            messages=QUESTION, tools=[WEATHER],
            sampling=common_pb2.SamplingParams(n=3, logprobs=1)))
        assert [c.index for c in response.choices] == [0, 1, 2]
        ids = set()
        for choice in response.choices:
            [call] = choice.tool_calls
            ids.add(call.id)
            assert choice.finish_reason == chat_pb2.CHAT_FINISH_REASON_TOOL_CALLS
            assert len(choice.logprobs) == len(TOKENIZER.encode(CALL_TEXT, False)) + 1
        assert len(ids) == 3

    _serve(CALL_TEXT, body)


@pytest.mark.timeout(30)
def test_a_tool_without_parameters_reaches_the_template_without_them() -> None:
    async def body(stub: chat_grpc.ChatServiceStub) -> None:
        response = await stub.RenderChat(chat_pb2.RenderChatRequest(
            messages=QUESTION, tools=[TIME]))
        assert '{"type": "function", "function": {"name": "get_time"}}' in response.prompt

    _serve(None, body)
