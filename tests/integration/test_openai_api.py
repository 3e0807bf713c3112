"""The OpenAI-compatible HTTP API through the real cluster (`corestream serve
--http-port`), driven by the official `openai` client on the built-in tiny
random-weight model and its own chat template (hermes tool calls).

What the client gets is checked with independent means: jsonschema for tool
arguments and structured output, and the gRPC API for the tokens (greedy requests
through both doors give the same answer). One cluster serves the module.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from typing import Any

import grpc
import jsonschema
import openai
import pytest
from corestream.common.v1 import common_pb2
from corestream.generate.v1 import admin_service_pb2 as admin_pb2
from corestream.generate.v1 import admin_service_pb2_grpc as admin_grpc
from corestream.generate.v1 import chat_service_pb2 as chat_pb2
from corestream.generate.v1 import chat_service_pb2_grpc as chat_grpc
from corestream.generate.v1 import generate_service_pb2 as pb
from corestream.generate.v1 import generate_service_pb2_grpc as pb_grpc
from openai.lib.streaming.chat import ChatCompletionStreamState

from tests.integration.cluster import Cluster, free_port, frozen_running

TIMEOUT_S = 120
MODEL = "tiny-llama-v2"
PROMPT = "Once upon a time"
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
TOOLS: list[Any] = [
    {"type": "function",
     "function": {"name": name, "description": f"{name} tool", "parameters": schema}}
    for name, schema in SCHEMAS.items()
]
MESSAGES: list[Any] = [
    {"role": "system", "content": "You answer with tools."},
    {"role": "user", "content": "What is the weather in Paris?"},
]
GRPC_MESSAGES = [chat_pb2.ChatMessage(role=m["role"], content=m["content"]) for m in MESSAGES]


@pytest.fixture(scope="module")
def cluster() -> Iterator[tuple[Cluster, int]]:
    http_port = free_port()
    c = Cluster(["--engines", "1", "--reasoning-parser", "qwen3",
                 "--http-port", str(http_port)])
    yield c, http_port
    c.stop()


@pytest.fixture(scope="module")
def client(cluster: tuple[Cluster, int]) -> Iterator[openai.OpenAI]:
    _, http_port = cluster
    with openai.OpenAI(base_url=f"http://127.0.0.1:{http_port}/v1", api_key="unused",
                       max_retries=0, timeout=60) as client:
        yield client


@pytest.fixture(scope="module")
def channel(cluster: tuple[Cluster, int]) -> Iterator[grpc.Channel]:
    with grpc.insecure_channel(cluster[0].address) as channel:
        yield channel


def _greedy(max_tokens: int, **fields: Any) -> common_pb2.SamplingParams:
    return common_pb2.SamplingParams(temperature=0, max_tokens=max_tokens, **fields)


def _running(admin: admin_grpc.AdminServiceStub) -> int:
    """Requests running or waiting in the engines, by AdminService.GetEngineStats."""
    reply = admin.GetEngineStats(admin_pb2.GetEngineStatsRequest(), timeout=20)
    assert reply.results and all(r.ok for r in reply.results), reply
    stats = [json.loads(r.result_json) for r in reply.results]
    return sum(s["num_running"] + s["num_waiting"] for s in stats)


def _steps(admin: admin_grpc.AdminServiceStub) -> int:
    reply = admin.GetEngineStats(admin_pb2.GetEngineStatsRequest(), timeout=20)
    return sum(json.loads(r.result_json)["step_counter"] for r in reply.results)


def _check_call(call: Any, names: set[str]) -> None:
    assert call.type == "function" and call.id, call
    assert call.function.name in names, call
    jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])


@pytest.mark.timeout(TIMEOUT_S)
def test_models_lists_the_served_model(client: openai.OpenAI) -> None:
    models = client.models.list().data
    assert [(m.id, m.object, m.owned_by) for m in models] == [(MODEL, "model", "corestream")]


@pytest.mark.timeout(TIMEOUT_S)
def test_completions_n_seed_logprobs(client: openai.OpenAI) -> None:
    args: dict[str, Any] = {"model": MODEL, "prompt": PROMPT, "max_tokens": 12, "n": 2,
                            "seed": 11, "logprobs": 2}
    whole = client.completions.create(**args)
    assert whole.object == "text_completion" and whole.model == MODEL
    assert [c.index for c in whole.choices] == [0, 1]
    for choice in whole.choices:
        assert choice.finish_reason == "length"
        lp = choice.logprobs
        assert lp is not None and lp.tokens and lp.token_logprobs and lp.top_logprobs
        assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 12
        for token, logprob, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs,
                                       strict=True):
            # The sampled token is among its position's top entries, as OpenAI has it.
            assert logprob <= 0 and top.get(token) == logprob and 1 <= len(top) <= 3
        assert lp.text_offset is not None and lp.text_offset[0] == 0
    assert whole.usage is not None and whole.usage.completion_tokens == 24

    texts: dict[int, str] = {0: "", 1: ""}
    tokens: dict[int, list[str]] = {0: [], 1: []}
    finish: dict[int, str | None] = {}
    for chunk in client.completions.create(**args, stream=True):
        assert chunk.object == "text_completion" and chunk.model == MODEL
        [choice] = chunk.choices
        texts[choice.index] += choice.text
        if choice.logprobs is not None and choice.logprobs.tokens:
            tokens[choice.index] += choice.logprobs.tokens
        if choice.finish_reason is not None:
            finish[choice.index] = choice.finish_reason
    assert finish == {0: "length", 1: "length"}
    # The same seed, streamed or not, samples the same tokens.
    assert [texts[0], texts[1]] == [c.text for c in whole.choices]
    assert [tokens[0], tokens[1]] == [c.logprobs.tokens for c in whole.choices
                                      if c.logprobs is not None]


@pytest.mark.timeout(TIMEOUT_S)
def test_greedy_completion_matches_grpc(client: openai.OpenAI, channel: grpc.Channel) -> None:
    stub = pb_grpc.GenerateServiceStub(channel)
    ref = stub.Generate(pb.GenerateRequest(text=PROMPT, sampling=_greedy(24, logprobs=0)),
                        timeout=60).completions[0]
    ref_tokens = [p.token for p in ref.logprobs]
    assert len(ref.token_ids) == len(ref_tokens) == 24
    streamed_ref = "".join(r.text for r in stub.GenerateStream(pb.GenerateStreamRequest(
        text=PROMPT, sampling=_greedy(24)), timeout=60))
    assert streamed_ref == ref.text

    args: dict[str, Any] = {"model": MODEL, "prompt": PROMPT, "max_tokens": 24,
                            "temperature": 0, "logprobs": 0}
    [choice] = client.completions.create(**args).choices
    assert choice.text == ref.text
    assert choice.logprobs is not None and choice.logprobs.tokens == ref_tokens
    text, tokens = "", []
    for chunk in client.completions.create(**args, stream=True):
        for c in chunk.choices:
            text += c.text
            tokens += c.logprobs.tokens if c.logprobs and c.logprobs.tokens else []
    assert (text, tokens) == (ref.text, ref_tokens)

    # vLLM's return_token_ids: the same ids as gRPC's, whole and streamed.
    ids_args = {**args, "extra_body": {"return_token_ids": True}}
    [choice] = client.completions.create(**ids_args).choices
    assert choice.model_extra and choice.model_extra["token_ids"] == list(ref.token_ids)
    streamed_ids = [i for chunk in client.completions.create(**ids_args, stream=True)
                    for c in chunk.choices for i in (c.model_extra or {})["token_ids"]]
    assert streamed_ids == list(ref.token_ids)


@pytest.mark.timeout(TIMEOUT_S)
def test_greedy_chat_matches_grpc(client: openai.OpenAI, channel: grpc.Channel) -> None:
    chat = chat_grpc.ChatServiceStub(channel)
    [ref] = chat.Chat(chat_pb2.ChatRequest(messages=GRPC_MESSAGES, sampling=_greedy(24)),
                      timeout=60).choices
    streamed_ref = list(chat.ChatStream(chat_pb2.ChatStreamRequest(
        messages=GRPC_MESSAGES, sampling=_greedy(24)), timeout=60))
    assert ref.content and "".join(r.content for r in streamed_ref) == ref.content

    args: dict[str, Any] = {"model": MODEL, "messages": MESSAGES, "max_tokens": 24,
                            "temperature": 0}
    whole = client.chat.completions.create(**args)
    assert whole.object == "chat.completion" and whole.model == MODEL
    [choice] = whole.choices
    assert choice.message.role == "assistant" and choice.message.content == ref.content
    assert choice.finish_reason == "length"
    chunks = list(client.chat.completions.create(**args, stream=True))
    assert all(c.object == "chat.completion.chunk" for c in chunks)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == ref.content
    assert chunks[-1].choices[0].finish_reason == "length"


@pytest.mark.timeout(TIMEOUT_S)
@pytest.mark.parametrize("seed", [1, 2])
def test_required_tool_choice_gives_one_valid_call(client: openai.OpenAI, seed: int) -> None:
    args: dict[str, Any] = {"model": MODEL, "messages": MESSAGES, "tools": TOOLS,
                            "tool_choice": "required", "parallel_tool_calls": False,
                            "max_tokens": 200, "seed": seed, "temperature": 1}
    [choice] = client.chat.completions.create(**args).choices
    assert choice.finish_reason == "tool_calls"
    assert not choice.message.content
    assert choice.message.tool_calls is not None
    [call] = choice.message.tool_calls
    _check_call(call, set(SCHEMAS))

    calls: dict[int, dict[str, Any]] = {}
    finish = []
    for chunk in client.chat.completions.create(**args, stream=True):
        for c in chunk.choices:
            assert not c.delta.content
            if c.finish_reason is not None:
                finish.append(c.finish_reason)
            for delta in c.delta.tool_calls or ():
                if delta.index not in calls:
                    # A call opens with its id, type and name; its arguments follow.
                    assert delta.id and delta.type == "function", delta
                    assert delta.function is not None and delta.function.name, delta
                    calls[delta.index] = {"id": delta.id, "name": delta.function.name,
                                          "arguments": delta.function.arguments or ""}
                else:
                    assert delta.id is None and delta.function is not None, delta
                    assert not delta.function.name, delta
                    calls[delta.index]["arguments"] += delta.function.arguments or ""
    assert finish == ["tool_calls"]
    assert list(calls) == [0]
    # Same seed: the stream assembles to the same call (its id is the server's own).
    assert (calls[0]["name"], calls[0]["arguments"]) == (call.function.name,
                                                         call.function.arguments)


@pytest.mark.timeout(TIMEOUT_S)
@pytest.mark.parametrize("max_tokens", [30, 200])
def test_required_parallel_calls_leave_no_markup_and_stream_in_openais_shape(
    client: openai.OpenAI, max_tokens: int
) -> None:
    """`required` with parallel calls at their default, greedy: whole and streamed
    (through the openai package's own accumulator) give the same complete calls, and
    a call cut by max_tokens is neither a call nor content."""
    args: dict[str, Any] = {"model": MODEL, "messages": MESSAGES, "tools": TOOLS,
                            "tool_choice": "required", "max_tokens": max_tokens,
                            "temperature": 0}
    [choice] = client.chat.completions.create(**args).choices
    assert choice.finish_reason in ("tool_calls", "length")
    assert not choice.message.content, choice.message.content
    calls = choice.message.tool_calls or []
    for call in calls:
        _check_call(call, set(SCHEMAS))
    if choice.finish_reason == "tool_calls":
        assert calls

    state: ChatCompletionStreamState[None] = ChatCompletionStreamState()
    for chunk in client.chat.completions.create(**args, stream=True):
        for c in chunk.choices:
            indices = [d.index for d in c.delta.tool_calls or ()]
            assert len(set(indices)) == len(indices), c.delta  # one entry per call
        state.handle_chunk(chunk)
    # The snapshot: the final parse refuses a "length" answer.
    [streamed] = state.current_completion_snapshot.choices
    assert streamed.finish_reason == choice.finish_reason
    assert not streamed.message.content
    assert [(c.function.name, c.function.arguments) for c in streamed.message.tool_calls or []
            ] == [(c.function.name, c.function.arguments) for c in calls]


@pytest.mark.timeout(TIMEOUT_S)
def test_a_named_function_is_called_exactly_once(client: openai.OpenAI) -> None:
    for seed in (3, 4):
        [choice] = client.chat.completions.create(
            model=MODEL, messages=MESSAGES, tools=TOOLS, max_tokens=200, seed=seed,
            temperature=1,
            tool_choice={"type": "function", "function": {"name": "get_time"}}).choices
        assert choice.finish_reason == "tool_calls" and not choice.message.content
        [call] = choice.message.tool_calls or []
        _check_call(call, {"get_time"})


@pytest.mark.timeout(TIMEOUT_S)
def test_response_format(client: openai.OpenAI) -> None:
    args: dict[str, Any] = {"model": MODEL, "messages": MESSAGES, "max_tokens": 100}
    for seed in (3, 4):
        [choice] = client.chat.completions.create(**args, seed=seed, response_format={
            "type": "json_schema",
            "json_schema": {"name": "x", "schema": WEATHER_SCHEMA},
        }).choices
        assert choice.finish_reason == "stop"
        assert choice.message.content is not None
        jsonschema.validate(json.loads(choice.message.content), WEATHER_SCHEMA)

        [choice] = client.chat.completions.create(
            **args, seed=seed, response_format={"type": "json_object"}).choices
        assert choice.message.content is not None
        if choice.finish_reason == "length":  # random weights may write a long object
            assert choice.message.content.startswith("{")
        else:
            assert choice.finish_reason == "stop"
            assert isinstance(json.loads(choice.message.content), dict)


@pytest.mark.timeout(TIMEOUT_S)
def test_stream_options_include_usage(client: openai.OpenAI) -> None:
    options: Any = {"include_usage": True}
    completion = list(client.completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=8, n=2, seed=5, stream=True,
        stream_options=options))
    chat = list(client.chat.completions.create(
        model=MODEL, messages=MESSAGES, max_tokens=8, seed=5, stream=True,
        stream_options=options))
    for chunks, n in ((completion, 2), (chat, 1)):
        last = chunks[-1]
        assert last.choices == [] and last.usage is not None
        assert last.usage.completion_tokens == 8 * n
        assert last.usage.prompt_tokens > 0
        assert last.usage.total_tokens == last.usage.prompt_tokens + 8 * n
        assert all(c.choices and c.usage is None for c in chunks[:-1])


@pytest.mark.timeout(TIMEOUT_S)
def test_disconnect_mid_stream_frees_the_request(client: openai.OpenAI,
                                                 channel: grpc.Channel) -> None:
    admin = admin_grpc.AdminServiceStub(channel)
    assert _running(admin) == 0
    max_tokens = 2000
    def start() -> Any:
        return client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=max_tokens,
                                         temperature=0, stream=True,
                                         extra_body={"ignore_eos": True})

    # Frozen where it is, the request cannot run to its end before its client leaves,
    # however fast the engine steps against this client: left running, a fresh clone's
    # loaded run once reached 1,032 of its 2,000 tokens before the abort landed. Only the
    # disconnect can free it now.
    with frozen_running(admin, start) as stream:
        assert _running(admin) == 1
        before = _steps(admin)
        stream.close()
        deadline = time.monotonic() + 30
        while _running(admin):
            assert time.monotonic() < deadline, "the request still runs after its client left"
            time.sleep(0.05)
        # Each step decodes one token of the only request: had it run to its end, the
        # engine would have taken the rest of its max_tokens steps.
        steps = _steps(admin) - before
    assert steps < max_tokens // 2, steps


@pytest.mark.timeout(TIMEOUT_S)
def test_errors_come_back_in_openai_shape(client: openai.OpenAI) -> None:
    with pytest.raises(openai.NotFoundError) as not_found:
        client.chat.completions.create(model="gpt-nope", messages=MESSAGES)
    assert not_found.value.status_code == 404
    assert isinstance(not_found.value.body, dict)
    assert not_found.value.body["param"] == "model"
    assert not_found.value.body["code"] == "model_not_found"
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="gpt-nope", prompt=PROMPT)

    wizard: list[Any] = [{"role": "wizard", "content": "x"}]
    with pytest.raises(openai.BadRequestError) as bad:
        client.chat.completions.create(model=MODEL, messages=wizard)
    assert bad.value.status_code == 400
    assert isinstance(bad.value.body, dict)
    assert bad.value.body["param"] == "messages[0].role"
    assert bad.value.body["type"] == "invalid_request_error"
    assert "wizard" in bad.value.body["message"]


@pytest.mark.timeout(TIMEOUT_S)
def test_requests_the_door_refuses_count_as_rejected(cluster: tuple[Cluster, int],
                                                     client: openai.OpenAI) -> None:
    """Refusals of the door's own checks (a body that does not validate, a constraint a
    chat does not take) count in requests_rejected like the request path's: the soak
    (benchmarks/soak) found them missing from the metrics."""
    from benchmarks.soak.probes import request_counts, scrape

    port = cluster[1]
    before = scrape(port)
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model=MODEL, prompt=PROMPT, logprobs=50)
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model=MODEL, messages=MESSAGES,
                                       extra_body={"structured_outputs": {"regex": "a+"}})
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model=MODEL, prompt=PROMPT, temperature=-1)
    assert request_counts(before, scrape(port)) == {"samples finished": 0.0,
                                                    "rejected INVALID_ARGUMENT": 3.0}
