"""The OpenAI-compatible HTTP API end to end: the official `openai` client and raw
httpx against a FrontendServer (http_port=0) in front of a scripted engine.

The happy paths go through the SDK, as clients do; the wire details (error body
shape, headers, SSE framing, status codes the SDK hides) are read with httpx.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from corestream.common.v1 import common_pb2
from openai.lib.streaming.chat import ChatCompletionStreamState
from openai.types.chat import ChatCompletionChunk

from services.common.observability import Observability
from services.common.observability_config import ObservabilityConfig
from services.common.ports import free_port
from services.frontend.chat.template import ChatTemplates
from tests.unit.frontend.fakes import CALL_TEXT, FakeEngine
from tests.unit.frontend.fakes import CHAT_MODEL as MODEL
from tests.unit.frontend.fakes import CHAT_TOKENIZER as TOKENIZER
from tests.unit.frontend.openai_api.error_body import assert_openai_error
from tests.unit.frontend.openai_api.serving import ANSWER, KEY, Env
from tests.unit.frontend.openai_api.serving import script as _script
from tests.unit.frontend.openai_api.serving import serve as _serve
from tests.unit.frontend.openai_api.serving import sse_events as _sse_events

USER = [{"role": "user", "content": "Weather in Paris?"}]
WEATHER_TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                   "required": ["city"]}}}


# --- models -------------------------------------------------------------------------


@pytest.mark.timeout(30)
def test_models_lists_the_served_model() -> None:
    async def body(env: Env) -> None:
        page = await env.client().models.list()
        assert [m.id for m in page.data] == [MODEL.name]
        assert page.data[0].owned_by == "corestream"

    _serve(body)


@pytest.mark.timeout(30)
def test_served_model_name_is_listed_and_the_checkpoint_name_still_works() -> None:
    async def body(env: Env) -> None:
        client = env.client()
        page = await client.models.list()
        assert [m.id for m in page.data] == ["my-alias"]
        for name in ("my-alias", MODEL.name):
            response = await client.completions.create(model=name, prompt="hello",
                                                       max_tokens=3)
            assert response.model == "my-alias"
        with pytest.raises(openai.NotFoundError):
            await client.completions.create(model="other", prompt="hello")

    _serve(body, served_model_name="my-alias")


# --- completions --------------------------------------------------------------------


@pytest.mark.timeout(30)
def test_completion_whole_and_streamed() -> None:
    async def body(env: Env) -> None:
        client = env.client()
        whole = await client.completions.create(model=MODEL.name, prompt="hello",
                                                max_tokens=100)
        choice = whole.choices[0]
        assert (choice.index, choice.text, choice.finish_reason) == (0, ANSWER, "stop")
        assert whole.object == "text_completion" and whole.model == MODEL.name
        add = env.engine.adds[-1]
        assert whole.usage is not None
        assert whole.usage.prompt_tokens == len(add.prompt_token_ids)
        assert whole.usage.completion_tokens == len(env.engine.script)
        assert whole.usage.total_tokens == (whole.usage.prompt_tokens
                                            + whole.usage.completion_tokens)

        short = await client.completions.create(model=MODEL.name, prompt="hello",
                                                max_tokens=3)
        assert short.choices[0].finish_reason == "length"
        assert short.choices[0].text == TOKENIZER.decode(env.engine.script[:3])
        assert short.usage is not None and short.usage.completion_tokens == 3

        stream = await client.completions.create(
            model=MODEL.name, prompt="hello", max_tokens=100, stream=True,
            stream_options={"include_usage": True})
        chunks = [chunk async for chunk in stream]
        assert "".join(c.choices[0].text for c in chunks if c.choices) == ANSWER
        finishes = [c.choices[0].finish_reason for c in chunks if c.choices]
        assert finishes[-1] == "stop" and set(finishes[:-1]) == {None}
        assert chunks[-1].choices == [] and chunks[-1].usage is not None
        assert chunks[-1].usage.completion_tokens == len(env.engine.script)
        assert all(c.usage is None for c in chunks[:-1])
        assert {c.id for c in chunks} == {chunks[0].id}

    _serve(body)


@pytest.mark.timeout(30)
def test_completion_stream_is_sse_framed_and_ends_with_done() -> None:
    async def body(env: Env) -> None:
        async with env.http() as http:
            response = await http.post("/v1/completions", json={
                "model": MODEL.name, "prompt": "hello", "max_tokens": 100, "stream": True})
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        events = _sse_events(response.text)
        assert events[-1] == "[DONE]"
        chunks = [json.loads(event) for event in events[:-1]]
        assert "".join(c["choices"][0]["text"] for c in chunks) == ANSWER
        # Without include_usage there is no usage chunk.
        assert all(c["choices"] for c in chunks)

    _serve(body)


@pytest.mark.timeout(30)
def test_completion_n_logprobs_several_prompts_and_stop() -> None:
    async def body(env: Env) -> None:
        client = env.client()
        two = await client.completions.create(model=MODEL.name, prompt="hello", n=2,
                                              max_tokens=100)
        assert [c.index for c in two.choices] == [0, 1]
        assert [c.text for c in two.choices] == [ANSWER, ANSWER]

        scored = await client.completions.create(model=MODEL.name, prompt="hello",
                                                 max_tokens=4, logprobs=2)
        logprobs = scored.choices[0].logprobs
        assert logprobs is not None and logprobs.tokens and logprobs.top_logprobs
        assert env.engine.adds[-1].sampling.logprobs == 2
        assert len(logprobs.tokens) == len(logprobs.token_logprobs or []) == 4
        assert logprobs.token_logprobs == [0.0, -1.0, -2.0, -3.0]
        assert len(logprobs.top_logprobs) == 4
        for token, top in zip(logprobs.tokens, logprobs.top_logprobs, strict=True):
            # The two alternatives, plus the sampled token as OpenAI includes it.
            assert 2 <= len(top) <= 3 and token in top
        assert logprobs.text_offset is not None and logprobs.text_offset[0] == 0

        many = await client.completions.create(model=MODEL.name, prompt=["hello", "world"],
                                               n=2, max_tokens=100)
        assert [c.index for c in many.choices] == [0, 1, 2, 3]
        assert all(c.text == ANSWER for c in many.choices)
        prompts = {TOKENIZER.decode(list(a.prompt_token_ids)) for a in env.engine.adds[-2:]}
        assert prompts == {"hello", "world"}
        assert many.usage is not None
        assert many.usage.completion_tokens == 4 * len(env.engine.script)

        stream = await client.completions.create(model=MODEL.name, prompt=["hello", "world"],
                                                 n=2, max_tokens=100, stream=True)
        texts: dict[int, str] = {}
        async for chunk in stream:
            for c in chunk.choices:
                texts[c.index] = texts.get(c.index, "") + c.text
        assert texts == dict.fromkeys(range(4), ANSWER)

        stopped = await client.completions.create(model=MODEL.name, prompt="hello",
                                                  max_tokens=100, stop=["sunny"])
        choice = stopped.choices[0]
        assert choice.text == "Weather in Paris is "
        assert choice.finish_reason == "stop"
        assert choice.model_extra and choice.model_extra["stop_reason"] == "sunny"

    _serve(body)


# --- chat ---------------------------------------------------------------------------


@pytest.mark.timeout(30)
def test_chat_whole_answer_with_a_tool_call() -> None:
    async def body(env: Env) -> None:
        response = await env.client().chat.completions.create(
            model=MODEL.name, messages=USER, tools=[WEATHER_TOOL])
        choice = response.choices[0]
        assert choice.finish_reason == "tool_calls"
        assert choice.message.role == "assistant"
        assert choice.message.content == "Let me check."
        calls = choice.message.tool_calls
        assert calls is not None and len(calls) == 1
        assert calls[0].type == "function" and calls[0].id
        assert calls[0].function.name == "get_weather"
        assert json.loads(calls[0].function.arguments) == {"city": "Paris"}
        assert response.object == "chat.completion"
        assert response.usage is not None
        assert response.usage.prompt_tokens == len(env.engine.adds[-1].prompt_token_ids)
        # The tools reached the template, hence the engine's prompt.
        assert "get_weather" in TOKENIZER.decode(list(env.engine.adds[-1].prompt_token_ids))

    _serve(body, "Let me check.\n" + CALL_TEXT)


@pytest.mark.timeout(30)
def test_chat_stream_roles_deltas_tool_call_and_usage() -> None:
    async def body(env: Env) -> None:
        async with env.http() as http:
            response = await http.post("/v1/chat/completions", json={
                "model": MODEL.name, "messages": USER, "tools": [WEATHER_TOOL],
                "stream": True, "stream_options": {"include_usage": True}})
        assert response.status_code == 200
        events = _sse_events(response.text)
        assert events[-1] == "[DONE]"
        chunks = [json.loads(event) for event in events[:-1]]
        assert all(c["object"] == "chat.completion.chunk" for c in chunks)
        *answer, last = chunks
        assert last["choices"] == [] and last["usage"]["completion_tokens"] == len(
            env.engine.script)
        assert all("usage" not in c or c["usage"] is None for c in answer)
        deltas = [c["choices"][0]["delta"] for c in answer]
        assert deltas[0]["role"] == "assistant"
        assert all("role" not in d for d in deltas[1:])
        assert "".join(d.get("content") or "" for d in deltas) == "Let me check."
        calls = [call for d in deltas for call in d.get("tool_calls", ())]
        assert calls and calls[0]["id"] and calls[0]["type"] == "function"
        assert calls[0]["function"]["name"] == "get_weather"
        assert all("id" not in call and "name" not in call["function"] for call in calls[1:])
        assert {call["index"] for call in calls} == {0}
        arguments = "".join(call["function"]["arguments"] for call in calls)
        assert json.loads(arguments) == {"city": "Paris"}
        finishes = [c["choices"][0]["finish_reason"] for c in answer]
        assert finishes[-1] == "tool_calls" and set(finishes[:-1]) == {None}

        # The SDK reads the same stream.
        stream = await env.client().chat.completions.create(
            model=MODEL.name, messages=USER, tools=[WEATHER_TOOL],
            stream=True)
        sdk_chunks = [chunk async for chunk in stream]
        content = "".join(c.choices[0].delta.content or "" for c in sdk_chunks)
        assert content == "Let me check."
        assert sdk_chunks[-1].choices[0].finish_reason == "tool_calls"

    _serve(body, "Let me check.\n" + CALL_TEXT)


@pytest.mark.timeout(30)
def test_streamed_tool_calls_take_openais_delta_shape() -> None:
    """The real SSE stream, read by the openai package's own accumulator (what its
    `.stream()` helper runs): two calls after some content."""

    async def body(env: Env) -> None:
        async with env.http() as http:
            response = await http.post("/v1/chat/completions", json={
                "model": MODEL.name, "messages": USER, "tools": [WEATHER_TOOL],
                "stream": True})
        assert response.status_code == 200
        chunks = [ChatCompletionChunk.model_validate_json(event)
                  for event in _sse_events(response.text)[:-1]]
        state: ChatCompletionStreamState[None] = ChatCompletionStreamState(
            input_tools=[WEATHER_TOOL])  # type: ignore[list-item]
        events = [event for chunk in chunks for event in state.handle_chunk(chunk)]
        seen: set[int] = set()
        for chunk in chunks:
            deltas = chunk.choices[0].delta.tool_calls or []
            # One entry per call per chunk; a call's first carries its id and name.
            assert len({d.index for d in deltas}) == len(deltas)
            for delta in deltas:
                assert delta.function is not None
                if delta.index not in seen:
                    assert delta.id and delta.type == "function" and delta.function.name
                else:
                    assert delta.id is None and delta.function.name is None
                seen.add(delta.index)
        assert seen == {0, 1}
        done = [(e.name, e.arguments) for e in events
                if e.type == "tool_calls.function.arguments.done"]
        assert done == [("get_weather", '{"city":"Paris"}')] * 2
        final = state.get_final_completion().choices[0]
        assert final.finish_reason == "tool_calls"
        assert final.message.content == "Let me check."
        calls = final.message.tool_calls or []
        assert [(c.index, c.function.name) for c in calls] == [  # type: ignore[attr-defined]
            (0, "get_weather"), (1, "get_weather")]
        assert all(c.id for c in calls) and calls[0].id != calls[1].id
        assert [json.loads(c.function.arguments) for c in calls] == [{"city": "Paris"}] * 2

    _serve(body, f"Let me check.\n{CALL_TEXT}\n{CALL_TEXT}")


@pytest.mark.timeout(30)
def test_a_forced_call_cut_by_max_tokens_leaves_no_markup_in_content() -> None:
    two_calls = f"{CALL_TEXT}\n{CALL_TEXT}"
    max_tokens = len(_script(two_calls, eos=False)) - 3

    async def body(env: Env) -> None:
        client = env.client()
        for tool_choice in ("required", "auto"):
            response = await client.chat.completions.create(
                model=MODEL.name, messages=USER, tools=[WEATHER_TOOL],
                tool_choice=tool_choice, max_tokens=max_tokens)  # type: ignore[arg-type]
            choice = response.choices[0]
            assert choice.finish_reason == "length"
            assert choice.message.content is None
            assert [c.function.name for c in choice.message.tool_calls or []] == [
                "get_weather"]
            stream = await client.chat.completions.create(
                model=MODEL.name, messages=USER, tools=[WEATHER_TOOL],
                tool_choice=tool_choice, max_tokens=max_tokens,  # type: ignore[arg-type]
                stream=True)
            state: ChatCompletionStreamState[None] = ChatCompletionStreamState()
            async for chunk in stream:
                state.handle_chunk(chunk)
            # The snapshot: the final parse refuses a "length" answer.
            final = state.current_completion_snapshot.choices[0]
            assert final.finish_reason == "length" and not final.message.content
            assert len(final.message.tool_calls or []) == 1

    _serve(body, two_calls)


@pytest.mark.timeout(30)
def test_chat_extra_body_reaches_the_engine() -> None:
    template = "{{ greeting }}{% for m in messages %}{{ m.content }}{% endfor %}"

    async def body(env: Env) -> None:
        response = await env.client().chat.completions.create(
            model=MODEL.name, messages=USER,
            extra_body={"chat_template_kwargs": {"greeting": "Hello there! "}, "top_k": 5})
        assert response.choices[0].message.content == ANSWER
        add = env.engine.adds[-1]
        assert add.sampling.top_k == 5
        assert TOKENIZER.decode(list(add.prompt_token_ids)) == (
            "Hello there! Weather in Paris?")

    _serve(body, templates=ChatTemplates(default=template))


@pytest.mark.timeout(30)
def test_chat_tool_choice_required_and_json_schema_constrain_the_engine() -> None:
    schema = {"type": "object", "properties": {"city": {"type": "string"}},
              "required": ["city"]}

    async def body(env: Env) -> None:
        client = env.client()
        plain = await client.chat.completions.create(model=MODEL.name, messages=USER)
        assert plain.choices[0].message.content is not None
        assert env.engine.adds[-1].sampling.WhichOneof("constraint") is None

        response = await client.chat.completions.create(
            model=MODEL.name, messages=USER, tools=[WEATHER_TOOL],
            tool_choice="required")
        assert env.engine.adds[-1].sampling.grammar
        calls = response.choices[0].message.tool_calls
        assert calls and calls[0].function.name == "get_weather"

        await client.chat.completions.create(
            model=MODEL.name, messages=USER,
            response_format={"type": "json_schema",
                             "json_schema": {"name": "city", "schema": schema}})
        sent = env.engine.adds[-1].sampling
        assert sent.WhichOneof("constraint") == "json_schema"
        assert json.loads(sent.json_schema) == schema

    _serve(body, CALL_TEXT)


# --- errors -------------------------------------------------------------------------


@pytest.mark.timeout(30)
def test_bad_requests_get_400_with_the_field_at_fault() -> None:
    async def body(env: Env) -> None:
        async with env.http() as http:
            response = await http.post("/v1/chat/completions", content=b"{not json",
                                       headers={"content-type": "application/json"})
            error = assert_openai_error(response, 400, "body", "JSON")
            assert error["type"] == "invalid_request_error"

            response = await http.post("/v1/completions", json={
                "model": MODEL.name, "prompt": "hello", "max_tokens": "many"})
            assert_openai_error(response, 400, "max_tokens", "max_tokens")

            response = await http.post("/v1/chat/completions", json={
                "model": MODEL.name, "messages": [{"role": "robot", "content": "hi"}]})
            assert_openai_error(response, 400, "messages[0].role", "robot")

            response = await http.post("/v1/chat/completions", json={
                "model": MODEL.name, "messages": USER, "temperature": -1})
            assert_openai_error(response, 400, "temperature", "temperature")

            response = await http.post("/v1/completions", json={
                "model": MODEL.name, "prompt": "hello", "temperature": -1, "stream": True})
            assert_openai_error(response, 400, "temperature", "temperature")

            response = await http.post("/v1/chat/completions", json={
                "model": "nope", "messages": USER})
            error = assert_openai_error(response, 404, "model", "nope")
            assert error["code"] == "model_not_found"

        client = env.client()
        with pytest.raises(openai.BadRequestError) as bad:
            await client.chat.completions.create(model=MODEL.name, messages=USER,
                                                 temperature=-1)
        assert bad.value.status_code == 400 and bad.value.param == "temperature"
        with pytest.raises(openai.NotFoundError):
            await client.chat.completions.create(model="nope", messages=USER)
        assert env.engine.adds == []

    _serve(body)


@pytest.mark.timeout(30)
def test_body_larger_than_max_message_bytes_is_refused() -> None:
    async def body(env: Env) -> None:
        async with env.http() as http:
            big = {"model": MODEL.name, "prompt": "hello " * 1000}
            response = await http.post("/v1/completions", json=big)
            error = assert_openai_error(response, 413, "body", "4096", "--max-message-bytes")
            assert error["code"] == "body_too_large"

            # Streamed without a length: refused while reading.
            async def chunks() -> Any:
                for _ in range(10):
                    yield b" " * 1000
            response = await http.post("/v1/completions", content=chunks())
            assert_openai_error(response, 413, "body", "4096")

            ok = await http.post("/v1/completions", json={
                "model": MODEL.name, "prompt": "hello", "max_tokens": 2})
            assert ok.status_code == 200
        assert len(env.engine.adds) == 1

    _serve(body, max_message_bytes=4096)


@pytest.mark.timeout(30)
def test_api_keys_guard_the_api_but_not_health(tmp_path: Path) -> None:
    keys = tmp_path / "keys"
    keys.write_text(f"# the test's key\n{KEY}\n", encoding="utf-8")

    async def body(env: Env) -> None:
        async with env.http() as http:
            response = await http.get("/v1/models")
            error = assert_openai_error(response, 401, None, "Bearer")
            assert error["type"] == "authentication_error"
            response = await http.post("/v1/completions", json={
                "model": MODEL.name, "prompt": "hello"}, headers={"Authorization": "Bearer x"})
            assert_openai_error(response, 401, None)
            for path in ("/v1/embeddings", "/v1/score", "/v1/rerank", "/classify"):
                response = await http.post(path, json={"input": "hello"})
                assert_openai_error(response, 401, None, "Bearer")
            # Probes carry no key.
            assert (await http.get("/health")).status_code == 200
        with pytest.raises(openai.AuthenticationError):
            await env.client("wrong").models.list()
        with pytest.raises(openai.AuthenticationError):
            await env.client("wrong").chat.completions.create(model=MODEL.name, messages=USER)
        assert env.engine.adds == []
        client = env.client()
        assert [m.id for m in (await client.models.list()).data] == [MODEL.name]
        response = await client.completions.create(model=MODEL.name, prompt="hello",
                                                   max_tokens=100)
        assert response.choices[0].text == ANSWER

    _serve(body, api_key_file=str(keys))


@pytest.mark.timeout(30)
def test_pooling_routes_on_a_generative_model_are_400_naming_the_task() -> None:
    async def body(env: Env) -> None:
        async with env.http() as http:
            models = (await http.get("/v1/models")).json()["data"]
            assert models[0]["tasks"] == ["generate"]
            for path, fields, task in (
                    ("/v1/embeddings", {"input": "hi"}, "embed"),
                    ("/classify", {"input": ["hi"]}, "classify"),
                    ("/v1/score", {"text_1": "hi", "text_2": ["ho"]}, "score"),
                    ("/rerank", {"query": "hi", "documents": ["ho"]}, "score")):
                response = await http.post(path, json={"model": MODEL.name, **fields})
                error = assert_openai_error(response, 400, None, f"{task} needs a pooling model")
                assert error["code"] == "failed_precondition"
            response = await http.post("/v1/embeddings", json={"model": "nope", "input": "x"})
            assert_openai_error(response, 404, "model", "nope")
        assert env.engine.adds == []

    _serve(body)


def _families(text: str) -> set[str]:
    return {line.split()[2] for line in text.splitlines() if line.startswith("# TYPE ")}


@pytest.mark.timeout(30)
def test_metrics_on_the_http_port_are_the_metrics_ports_without_a_key(tmp_path: Path) -> None:
    keys = tmp_path / "keys"
    keys.write_text(f"{KEY}\n", encoding="utf-8")
    observability = Observability("frontend", ObservabilityConfig(metrics_port=free_port()),
                                  "127.0.0.1")

    async def body(env: Env) -> None:
        metrics_port = env.frontend.observability.start_metrics()
        try:
            client = env.client()
            await client.completions.create(model=MODEL.name, prompt="hello", max_tokens=2)
            async with env.http() as http:
                # No key, as on the metrics port and /health.
                response = await http.get("/metrics")
                on_port = await http.get(f"http://127.0.0.1:{metrics_port}/metrics")
                openmetrics = await http.get(
                    "/metrics", headers={"Accept": "application/openmetrics-text"})
                assert (await http.post("/metrics")).status_code == 405
        finally:
            env.frontend.observability.shutdown()
        assert response.status_code == on_port.status_code == 200
        assert response.headers["content-type"] == on_port.headers["content-type"]
        assert response.headers["content-type"].startswith("text/plain")
        assert _families(response.text) == _families(on_port.text)
        assert 'corestream:request_success_total{' in response.text
        assert "corestream:config_info{" in response.text  # the frontend's own config
        assert "process_cpu_seconds_total" in response.text
        assert openmetrics.headers["content-type"].startswith("application/openmetrics-text")
        assert openmetrics.text.endswith("# EOF\n")

    _serve(body, api_key_file=str(keys), observability=observability)


@pytest.mark.timeout(30)
def test_engine_overload_is_429_with_retry_after() -> None:
    engine = FakeEngine(_script(ANSWER), step_s=0.001)
    engine.error = (8, "the engine is overloaded")

    async def body(env: Env) -> None:
        async with env.http() as http:
            response = await http.post("/v1/chat/completions", json={
                "model": MODEL.name, "messages": USER})
            error = assert_openai_error(response, 429, None)
            assert error["type"] == "rate_limit_error"
            assert int(response.headers["retry-after"]) >= 1

            response = await http.post("/v1/completions", json={
                "model": MODEL.name, "prompt": "hello", "stream": True})
            assert_openai_error(response, 429, None)
            assert int(response.headers["retry-after"]) >= 1
        with pytest.raises(openai.RateLimitError):
            await env.client().completions.create(model=MODEL.name, prompt="hello")

    _serve(body, engine=engine)


@pytest.mark.timeout(30)
def test_no_engine_is_503_and_unhealthy() -> None:
    async def body(env: Env) -> None:
        async with env.http() as http:
            assert (await http.get("/health")).status_code == 503
            response = await http.post("/v1/completions", json={
                "model": MODEL.name, "prompt": "hello"})
            assert_openai_error(response, 503, None)
        with pytest.raises(openai.InternalServerError) as info:
            await env.client().chat.completions.create(model=MODEL.name, messages=USER)
        assert info.value.status_code == 503

    _serve(body, engines=("127.0.0.1:1",))


@pytest.mark.timeout(30)
def test_health_is_200_with_an_engine() -> None:
    async def body(env: Env) -> None:
        async with env.http() as http:
            response = await http.get("/health")
        assert response.status_code == 200

    _serve(body)


@pytest.mark.timeout(30)
def test_a_draining_frontend_refuses_new_requests_with_503() -> None:
    engine = FakeEngine(_script("hello " * 100, eos=False), step_s=0.02)

    async def body(env: Env) -> None:
        async with env.http() as http, http.stream("POST", "/v1/completions", json={
                "model": MODEL.name, "prompt": "hello", "max_tokens": 100,
                "stream": True}) as running:
            assert running.status_code == 200
            lines = running.aiter_lines()
            assert (await anext(lines)).startswith("data: ")
            # stop() drains: the running request may finish, new ones are refused.
            stopping = asyncio.ensure_future(env.frontend.stop(10))
            while (await http.get("/health")).status_code == 200:
                await asyncio.sleep(0.01)
            response = await http.post("/v1/chat/completions", json={
                "model": MODEL.name, "messages": USER})
            error = assert_openai_error(response, 503, None, "draining")
            assert error["type"] == "service_unavailable"
            assert len(env.engine.adds) == 1
            # The running stream goes on while draining.
            assert (await anext(lines)) == ""
            assert (await anext(lines)).startswith("data: ")
        await stopping

    _serve(body, engine=engine)


@pytest.mark.timeout(30)
def test_x_request_id_is_used_and_echoed_and_a_running_duplicate_is_409() -> None:
    engine = FakeEngine(_script("hello " * 100, eos=False), step_s=0.02)

    async def body(env: Env) -> None:
        async with env.http() as http:
            response = await http.post("/v1/chat/completions", json={
                "model": MODEL.name, "messages": USER, "max_tokens": 2},
                headers={"X-Request-Id": "my-id-1"})
            assert response.status_code == 200
            assert response.headers["x-request-id"] == "my-id-1"
            assert response.json()["id"] == "chatcmpl-my-id-1"
            assert env.engine.adds[-1].request_id == "my-id-1"

            response = await http.post("/v1/completions", json={
                "model": MODEL.name, "prompt": "hello", "max_tokens": 2, "stream": True},
                headers={"X-Request-Id": "my-id-2"})
            assert response.headers["x-request-id"] == "my-id-2"
            assert json.loads(_sse_events(response.text)[0])["id"] == "cmpl-my-id-2"
            assert env.engine.adds[-1].request_id == "my-id-2"

            async with http.stream("POST", "/v1/completions", json={
                    "model": MODEL.name, "prompt": "hello", "max_tokens": 100,
                    "stream": True}, headers={"X-Request-Id": "dup"}) as running:
                assert (await anext(running.aiter_lines())).startswith("data: ")
                response = await http.post("/v1/completions", json={
                    "model": MODEL.name, "prompt": "hello"}, headers={"X-Request-Id": "dup"})
                assert_openai_error(response, 409, "request_id", "dup")
                assert response.headers["x-request-id"] == "dup"

            response = await http.post("/v1/completions", json={
                "model": MODEL.name, "prompt": "hello"}, headers={"X-Request-Id": "x" * 10000})
            assert_openai_error(response, 400, "request_id")
            # Not echoed: a new id names the refusal.
            assert len(response.headers["x-request-id"]) == 32
            # Found by the HTTP fuzzer: an id with an outer space cannot be a header
            # value, and the answer was a closed connection.
            for path, body_json in (("/v1/completions", {"prompt": "hello"}),
                                    ("/v1/embeddings", {"input": "hello"}),
                                    ("/generate", {"text": "hello"})):
                response = await http.post(path, json={"model": MODEL.name, **body_json,
                                                       "request_id": " ", "rid": "x "})
                assert_openai_error(response, 400, "request_id", "space")

            # Refused before the id was settled (the body, the model): echoed all the same.
            for path, body_json in (("/v1/completions", {"model": MODEL.name}),
                                    ("/v1/chat/completions", {"model": "gpt-nope",
                                                              "messages": USER})):
                response = await http.post(path, json=body_json,
                                           headers={"X-Request-Id": "early"})
                assert response.status_code in (400, 404)
                assert response.headers["x-request-id"] == "early"

    _serve(body, engine=engine)


def _request_id_header(response: httpx.Response, sent: str | None) -> None:
    request_id = response.headers.get("x-request-id")
    assert request_id == sent if sent else request_id, response.headers


@pytest.mark.timeout(30)
def test_every_error_names_openai_params_with_a_snake_case_code_and_a_request_id() -> None:
    """One naming scheme at the HTTP door: `param` and the message name the body's
    field (never the proto's `sampling.`), `code` is lower snake case, and the
    response carries X-Request-Id: the client's, or a new one."""
    chat = {"model": MODEL.name, "messages": USER}
    completion = {"model": MODEL.name, "prompt": "hello"}
    cases: list[tuple[str, str, Any, int, str | None, str]] = [
        # (method, path, body, status, param, code)
        ("POST", "/v1/chat/completions", {**chat, "temperature": -1}, 400, "temperature",
         "invalid_argument"),
        ("POST", "/v1/completions", {**completion, "top_k": -5}, 400, "top_k",
         "invalid_argument"),
        ("POST", "/v1/completions", {**completion, "min_tokens": 20, "max_tokens": 10}, 400,
         "min_tokens", "invalid_argument"),
        ("POST", "/v1/chat/completions", {**chat, "logprobs": True, "top_logprobs": 30}, 400,
         "top_logprobs", "invalid_argument"),
        ("POST", "/v1/completions", {**completion, "max_tokens": 4095}, 400, "max_tokens",
         "prompt_too_long"),
        ("POST", "/v1/chat/completions", {**chat, "max_completion_tokens": 4095}, 400,
         "max_completion_tokens", "prompt_too_long"),
        ("POST", "/v1/completions", {**completion, "prompt": "hello " * 5000}, 400,
         "prompt", "prompt_too_long"),
        ("POST", "/v1/chat/completions",
         {**chat, "messages": [{"role": "user", "content": "hello " * 5000}]}, 400,
         "messages", "prompt_too_long"),
        ("POST", "/v1/completions", {**completion, "prompt": [5, 99999]}, 400, "prompt",
         "invalid_argument"),
        ("POST", "/v1/chat/completions",
         {**chat, "tools": [WEATHER_TOOL],
          "tool_choice": {"type": "function", "function": {"name": "nope"}}}, 400,
         "tool_choice.function.name", "invalid_argument"),
        ("POST", "/v1/chat/completions", {**chat, "model": "gpt-nope"}, 404, "model",
         "model_not_found"),
        ("POST", "/v1/completions", b"{not json", 400, "body", "invalid_argument"),
        ("GET", "/v1/completions", None, 405, None, "method_not_allowed"),
        ("POST", "/v1/models", None, 405, None, "method_not_allowed"),
        ("GET", "/v1/nothing-here", None, 404, None, "not_found"),
        ("POST", "/v2/chat/completions", chat, 404, None, "not_found"),
    ]

    async def body(env: Env) -> None:
        async with env.http() as http:
            for method, path, data, status, param, code in cases:
                for sent in (None, "client-id-7"):
                    headers = {"X-Request-Id": sent} if sent else {}
                    if isinstance(data, bytes):
                        response = await http.request(method, path, content=data,
                                                      headers=headers)
                    else:
                        response = await http.request(method, path, json=data,
                                                      headers=headers)
                    error = assert_openai_error(response, status, param)
                    case = (method, path, error)
                    assert error["code"] == code, case
                    assert "sampling." not in error["message"], case
                    assert "token_ids" not in error["message"], case
                    if param is not None:
                        assert param in error["message"], case
                    _request_id_header(response, sent)
            response = await http.get("/v1/completions")
            assert response.headers["allow"] == "POST"
        assert env.engine.adds == []

    _serve(body)


# --- disconnects --------------------------------------------------------------------


@pytest.mark.timeout(30)
@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_a_client_leaving_a_stream_aborts_the_request(path: str) -> None:
    engine = FakeEngine(_script("hello " * 200, eos=False), step_s=0.05)
    fields = ({"prompt": "hello", "max_tokens": 200} if path == "/v1/completions"
              else {"messages": USER, "max_tokens": 200})

    async def body(env: Env) -> None:
        async with env.http() as http, http.stream("POST", path, json={
                "model": MODEL.name, "stream": True, **fields},
                headers={"X-Request-Id": "leaver"}) as response:
            assert response.status_code == 200
            assert (await anext(response.aiter_lines())).startswith("data: ")
            assert env.engine.aborts == []
        async with asyncio.timeout(5):
            await env.engine.aborted.wait()
        assert env.engine.aborts == ["leaver"]

    _serve(body, engine=engine)


@pytest.mark.timeout(30)
@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_a_client_leaving_a_whole_request_aborts_it(path: str) -> None:
    engine = FakeEngine(_script("hello " * 200, eos=False), step_s=0.05)
    fields = ({"prompt": "hello", "max_tokens": 200} if path == "/v1/completions"
              else {"messages": USER, "max_tokens": 200})

    async def body(env: Env) -> None:
        async with env.http(timeout=httpx.Timeout(10, read=0.5)) as http:
            with pytest.raises(httpx.ReadTimeout):
                await http.post(path, json={"model": MODEL.name, **fields},
                                headers={"X-Request-Id": "impatient"})
        async with asyncio.timeout(5):
            await env.engine.aborted.wait()
        assert env.engine.aborts == ["impatient"]

    _serve(body, engine=engine)


@pytest.mark.timeout(30)
def test_the_sdk_closing_a_stream_aborts_the_request() -> None:
    engine = FakeEngine(_script("hello " * 200, eos=False), step_s=0.05)

    async def body(env: Env) -> None:
        client = env.client()
        stream = await client.chat.completions.create(
            model=MODEL.name, messages=USER, max_tokens=200, stream=True,
            extra_headers={"X-Request-Id": "sdk-leaver"})
        first = await anext(stream.__aiter__())
        assert first.choices[0].delta.role == "assistant"
        await stream.close()
        async with asyncio.timeout(5):
            await env.engine.aborted.wait()
        assert env.engine.aborts == ["sdk-leaver"]
        await client.close()

    _serve(body, engine=engine)


@pytest.mark.timeout(30)
def test_an_engine_dying_mid_stream_ends_the_stream_with_an_error_event() -> None:
    engine = FakeEngine(_script(ANSWER), step_s=0.001)
    engine.final_state = common_pb2.ENGINE_STATE_DEAD

    async def body(env: Env) -> None:
        async with env.http() as http:
            response = await http.post("/v1/completions", json={
                "model": MODEL.name, "prompt": "hello", "stream": True})
        assert response.status_code == 200
        events = _sse_events(response.text)
        assert events[-1] == "[DONE]"
        error = json.loads(events[-2])
        assert set(error) == {"error"}
        assert set(error["error"]) == {"message", "type", "param", "code"}
        assert error["error"]["type"] == "service_unavailable"
        assert json.loads(events[0])["choices"][0]["text"]

    _serve(body, engine=engine)


@pytest.mark.timeout(30)
def test_completion_prompt_logprobs_come_back_per_choice() -> None:
    async def body(env: Env) -> None:
        async with env.http() as http:
            response = await http.post("/v1/completions", json={
                "model": MODEL.name, "prompt": "hello world", "max_tokens": 2, "n": 2,
                "prompt_logprobs": 1})
        assert response.status_code == 200, response.text
        choices = response.json()["choices"]
        prompt_ids = list(env.engine.adds[0].prompt_token_ids)
        for choice in choices:
            entries = choice["prompt_logprobs"]
            assert entries[0] is None and len(entries) == len(prompt_ids)
            for token_id, entry in zip(prompt_ids[1:], entries[1:], strict=True):
                assert str(token_id) in entry

    _serve(body)
