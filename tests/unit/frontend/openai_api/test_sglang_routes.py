"""SGLang's worker routes (sglang_routes.py) with raw httpx against a FrontendServer in
front of a scripted engine: the shapes SGLang's model gateway reads and sends."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import grpc
import pytest
from corestream.common.v1 import common_pb2
from corestream.engine.v1 import engine_core_service_pb2 as engine_pb2
from prometheus_client.parser import text_string_to_metric_families

from services.frontend.errors import RequestError
from services.frontend.openai_api.sglang_routes import GenerateBody, generate_requests
from tests.unit.frontend.fakes import CHAT_MODEL as MODEL
from tests.unit.frontend.fakes import CHAT_TOKENIZER as TOKENIZER
from tests.unit.frontend.fakes import FakeEngine
from tests.unit.frontend.openai_api.serving import ANSWER, KEY, Env, script, serve, sse_events

BLOCK_SIZE = 16
NUM_BLOCKS = 321


class SizedEngine(FakeEngine):
    """A scripted engine that also answers GetEngineInfo, as a real one does."""

    async def GetEngineInfo(  # noqa: N802 (gRPC method name)
        self, request: engine_pb2.GetEngineInfoRequest, context: grpc.aio.ServicerContext
    ) -> engine_pb2.GetEngineInfoResponse:
        return engine_pb2.GetEngineInfoResponse(
            engine_index=0, model=MODEL.name, num_kv_blocks=NUM_BLOCKS,
            block_size=BLOCK_SIZE, state=common_pb2.ENGINE_STATE_RUNNING)


def _body(**fields: Any) -> GenerateBody:
    return GenerateBody.model_validate(fields)


def test_bodies_become_requests_with_sglangs_defaults() -> None:
    [one] = generate_requests(_body(text="hi", sampling_params={
        "max_new_tokens": 5, "min_new_tokens": 2, "temperature": 0, "stop": "x",
        "no_stop_trim": True, "sampling_seed": 7, "regex": "[a-z]+",
        "logit_bias": {"12": -1.5}}, data_parallel_rank=1))
    s = one.sampling
    assert (one.text, s.max_tokens, s.min_tokens, s.temperature, list(s.stop)) == (
        "hi", 5, 2, 0.0, ["x"])
    assert s.include_stop_str_in_output and s.seed == 7 and s.regex == "[a-z]+"
    assert dict(s.logit_bias) == {12: -1.5} and one.data_parallel_rank == 1
    [default] = generate_requests(_body(input_ids=[1, 2, 3]))
    assert list(default.token_ids.ids) == [1, 2, 3]
    assert default.sampling.max_tokens == 128  # SGLang's default, not the context
    assert not default.sampling.HasField("temperature")  # the server's default applies
    batch = generate_requests(_body(input_ids=[[1], [2, 3]]))
    assert [list(r.token_ids.ids) for r in batch] == [[1], [2, 3]]
    assert generate_requests(_body(text=["a", "b"]))[1].text == "b"
    assert generate_requests(_body(text="g", sampling_params={"ebnf": 'start: "a"'})
                             )[0].sampling.grammar == 'start: "a"'


@pytest.mark.parametrize(("fields", "param"), [
    ({}, "text"),
    ({"text": "a", "input_ids": [1]}, "text"),
    ({"text": "a", "return_logprob": True}, "return_logprob"),
    ({"text": "a", "lora_path": "x"}, "lora_path"),
    ({"text": ["a", "b"], "stream": True}, "stream"),
    ({"text": "a", "sampling_params": {"regex": "a", "json_schema": "{}"}},
     "sampling_params.regex"),
    ({"text": "a", "sampling_params": {"structural_tag": {}}}, "sampling_params.structural_tag"),
    # Were a 500: str.isdigit takes keys int() refuses, and a key past uint32 failed the
    # proto's map.
    ({"text": "a", "sampling_params": {"logit_bias": {"\u00b2": 1}}},
     "sampling_params.logit_bias"),
    ({"text": "a", "sampling_params": {"logit_bias": {"4294967296": 1}}},
     "sampling_params.logit_bias"),
])
def test_what_is_not_served_is_refused_naming_the_field(fields: dict[str, Any],
                                                       param: str) -> None:
    with pytest.raises(RequestError) as refused:
        generate_requests(_body(**fields))
    assert refused.value.field == param


@pytest.mark.timeout(30)
def test_generate_whole_batch_and_n() -> None:
    async def body(env: Env) -> None:
        async with env.http() as http:
            response = await http.post("/generate", json={
                "text": "hello", "sampling_params": {"max_new_tokens": 64}, "rid": "r-1"})
            assert response.status_code == 200, response.text
            answer = response.json()
            assert answer["text"] == ANSWER
            assert answer["output_ids"] == script(ANSWER)
            meta = answer["meta_info"]
            assert meta["id"] == "r-1" and meta["completion_tokens"] == len(script(ANSWER))
            assert meta["finish_reason"]["type"] == "stop"
            assert meta["prompt_tokens"] == len(TOKENIZER.encode("hello"))
            assert meta["e2e_latency"] > 0
            cut = (await http.post("/generate", json={
                "input_ids": [[5, 6], [7]], "sampling_params": {"max_new_tokens": 2}})).json()
            assert isinstance(cut, list) and len(cut) == 2
            for item in cut:
                assert item["meta_info"]["finish_reason"] == {"type": "length", "length": 2}
                assert item["output_ids"] == script(ANSWER)[:2]
            two = (await http.post("/generate", json={
                "text": "hello", "sampling_params": {"max_new_tokens": 3, "n": 2}})).json()
            assert [len(item["output_ids"]) for item in two] == [3, 3]

    serve(body)


@pytest.mark.timeout(30)
def test_generate_stream_is_cumulative_sse_ending_with_done() -> None:
    async def body(env: Env) -> None:
        async with env.http() as http:
            response = await http.post("/generate", json={
                "text": "hello", "stream": True, "sampling_params": {"max_new_tokens": 64}})
            assert response.status_code == 200
            assert response.headers["content-type"].startswith("text/event-stream")
        events = sse_events(response.text)
        assert events[-1] == "[DONE]"
        chunks = [json.loads(e) for e in events[:-1]]
        assert len(chunks) > 1
        texts = [c["text"] for c in chunks]
        for before, after in zip(texts, texts[1:], strict=False):
            assert after.startswith(before)  # SGLang streams the text so far
        assert texts[-1] == ANSWER
        assert chunks[-1]["output_ids"] == script(ANSWER)
        assert all(c["meta_info"]["finish_reason"] is None for c in chunks[:-1])
        assert chunks[-1]["meta_info"]["finish_reason"]["type"] == "stop"

    serve(body)


@pytest.mark.timeout(30)
def test_errors_name_sglangs_fields() -> None:
    async def body(env: Env) -> None:
        async with env.http() as http:
            response = await http.post("/generate", json={
                "text": "hello", "sampling_params": {"max_new_tokens": -1}})
            assert response.status_code == 400
            assert response.json()["error"]["param"] == "sampling_params.max_new_tokens"
            response = await http.post("/generate", json={"text": "hello", "stream": True,
                                                         "sampling_params": {"top_p": 7}})
            assert response.status_code == 400
            assert response.json()["error"]["param"] == "sampling_params.top_p"

    serve(body)


@pytest.mark.timeout(30)
def test_info_and_loads_routes_report_the_engines() -> None:
    async def body(env: Env) -> None:
        async with asyncio.timeout(10):
            while env.frontend.capacities.get(env.frontend.balancer.clients[0].address) is None:
                await asyncio.sleep(0.02)
        async with env.http() as http:
            for path in ("/server_info", "/get_server_info"):
                info = (await http.get(path)).json()
                assert info["model_path"] == MODEL.path and info["dp_size"] == 1
                assert info["context_length"] == MODEL.max_model_len
                assert info["max_total_tokens"] == NUM_BLOCKS * BLOCK_SIZE
                assert info["is_embedding"] is False
            for path in ("/model_info", "/get_model_info"):
                model = (await http.get(path)).json()
                assert model["is_generation"] is True
                assert model["architectures"] == list(MODEL.architectures)
            loads = (await http.get("/v1/loads")).json()
            assert loads["dp_rank_count"] == 1
            [rank] = loads["loads"]
            assert rank["max_total_num_tokens"] == NUM_BLOCKS * BLOCK_SIZE
            assert rank["num_running_reqs"] == rank["num_waiting_reqs"] == 0
            assert (await http.get("/health_generate")).status_code == 200

    serve(body, engine=SizedEngine(script(ANSWER)))


@pytest.mark.timeout(30)
def test_health_generate_is_503_without_an_engine() -> None:
    async def body(env: Env) -> None:
        async with env.http() as http:
            assert (await http.get("/health_generate")).status_code == 503
            assert (await http.get("/v1/loads")).json()["loads"] == []

    serve(body, engines=("127.0.0.1:1",))


@pytest.mark.timeout(30)
def test_the_routes_need_an_api_key(tmp_path: Path) -> None:
    keys = tmp_path / "keys"
    keys.write_text(KEY + "\n")

    async def body(env: Env) -> None:
        async with env.http() as http:
            for path in ("/server_info", "/model_info", "/v1/loads", "/health_generate"):
                assert (await http.get(path)).status_code == 401, path
            assert (await http.post("/generate", json={"text": "a"})).status_code == 401
            authed = {"Authorization": f"Bearer {KEY}"}
            assert (await http.get("/v1/loads", headers=authed)).status_code == 200
            response = await http.post("/generate", headers=authed, json={
                "text": "a", "sampling_params": {"max_new_tokens": 2}})
            assert response.status_code == 200

    serve(body, api_key_file=str(keys))


def _samples(text: str) -> dict[str, list[tuple[dict[str, str], float]]]:
    found: dict[str, list[tuple[dict[str, str], float]]] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            found.setdefault(sample.name, []).append((sample.labels, sample.value))
    return found


@pytest.mark.timeout(30)
def test_metrics_carry_the_server_totals_and_with_the_flag_vllms_names() -> None:
    engine = SizedEngine(script("hello " * 200, eos=False), step_s=0.02)

    async def body(env: Env) -> None:
        async with asyncio.timeout(10):
            while env.frontend.capacities.get(env.frontend.balancer.clients[0].address) is None:
                await asyncio.sleep(0.02)
        async with env.http() as http, http.stream("POST", "/generate", json={
                "text": "hello", "stream": True,
                "sampling_params": {"max_new_tokens": 200}}) as running:
            lines = running.aiter_lines()
            assert (await anext(lines)).startswith("data: ")
            found = _samples((await http.get("/metrics")).text)
        for prefix in ("corestream:server_", "vllm:"):
            # Static engines give no load figures: our in-flight requests count.
            assert found[prefix + "num_requests_running"] == [({"model_name": MODEL.name}, 1.0)]
            assert found[prefix + "num_requests_waiting"] == [({"model_name": MODEL.name}, 0.0)]
            assert found[prefix + "kv_cache_usage_perc"] == [({"model_name": MODEL.name}, 0.0)]
            assert found[prefix + "cache_config_info"] == [(
                {"model_name": MODEL.name, "block_size": str(BLOCK_SIZE),
                 "num_gpu_blocks": str(NUM_BLOCKS)}, 1.0)]
        assert "vllm:gpu_cache_usage_perc" in found
        [(lora, stamp)] = found["vllm:lora_requests_info"]
        assert lora == {"max_lora": "0", "running_lora_adapters": "",
                        "waiting_lora_adapters": ""} and stamp > 0

    serve(body, engine=engine, vllm_metric_names=True)


@pytest.mark.timeout(30)
def test_without_the_flag_no_vllm_names() -> None:
    async def body(env: Env) -> None:
        async with env.http() as http:
            found = _samples((await http.get("/metrics")).text)
        assert "corestream:server_num_requests_running" in found
        assert not [name for name in found if name.startswith("vllm:")]

    serve(body)
