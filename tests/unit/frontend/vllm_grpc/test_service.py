"""VllmEngine on the frontend in process, against a scripted engine on 127.0.0.1."""

from __future__ import annotations

import asyncio
from pathlib import Path

import grpc
import pytest
from corestream.generate.v1 import generate_service_pb2_grpc as pb_grpc
from corestream.vendor.smg_grpc_proto import common_pb2 as smg_pb2
from corestream.vendor.smg_grpc_proto import vllm_engine_pb2 as vllm_pb2
from corestream.vendor.smg_grpc_proto import vllm_engine_pb2_grpc as vllm_grpc
from google.rpc import error_details_pb2
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc
from grpc_status import rpc_status

from services.common.model_info import ModelInfo
from services.frontend.tokenizer import TextTokenizer
from services.frontend.vllm_grpc.service import SERVICE_NAME
from tests.unit.frontend.fakes import (
    EOS_ID,
    MAX_MODEL_LEN,
    TEXT,
    FakeEngine,
    script,
    serve_generate,
)

pytestmark = pytest.mark.timeout(60)


def bad_field(error: grpc.aio.AioRpcError) -> str:
    status = rpc_status.from_call(error)  # type: ignore[arg-type]
    assert status is not None
    for detail in status.details:
        if detail.Is(error_details_pb2.BadRequest.DESCRIPTOR):
            bad = error_details_pb2.BadRequest()
            detail.Unpack(bad)
            return bad.field_violations[0].field
    return ""


async def collect(stub: vllm_grpc.VllmEngineStub, request: vllm_pb2.GenerateRequest
                  ) -> list[vllm_pb2.GenerateResponse]:
    return [r async for r in stub.Generate(request)]


def test_generate_streams_token_ids_and_completes(tokenizer: TextTokenizer,
                                                  model_info: ModelInfo) -> None:
    tokens = script(tokenizer)

    async def body(_: pb_grpc.GenerateServiceStub, channel: grpc.aio.Channel) -> None:
        stub = vllm_grpc.VllmEngineStub(channel)
        out = await collect(stub, vllm_pb2.GenerateRequest(
            request_id="s1", text=TEXT, stream=True,
            sampling_params=vllm_pb2.SamplingParams(temperature=0, logprobs=1)))
        *chunks, complete = out
        assert all(r.WhichOneof("response") == "chunk" for r in chunks)
        assert [t for r in chunks for t in r.chunk.token_ids] == tokens
        prompt = tokenizer.encode(TEXT)
        assert {r.chunk.prompt_tokens for r in chunks} == {len(prompt)}
        assert complete.complete.finish_reason == "stop"  # the script ends with EOS
        assert list(complete.complete.output_ids) == [EOS_ID]
        assert complete.complete.completion_tokens == len(tokens)
        assert complete.complete.cached_tokens == 2  # the fake engine's figure
        assert len(chunks[0].chunk.output_logprobs.top_logprobs[0].values) == 1
        # Not streamed: the Complete alone, every token in it; two samples, two Completes.
        out = await collect(stub, vllm_pb2.GenerateRequest(
            tokenized=vllm_pb2.TokenizedInput(input_ids=prompt),
            sampling_params=vllm_pb2.SamplingParams(max_tokens=3, n=2)))
        assert [(r.complete.index, list(r.complete.output_ids), r.complete.finish_reason)
                for r in out] == [(0, tokens[:3], "length"), (1, tokens[:3], "length")]

    serve_generate(tokenizer, model_info, FakeEngine(tokens), body)


def test_bad_input_is_invalid_argument_naming_the_vllm_field(
        tokenizer: TextTokenizer, model_info: ModelInfo) -> None:
    async def body(_: pb_grpc.GenerateServiceStub, channel: grpc.aio.Channel) -> None:
        stub = vllm_grpc.VllmEngineStub(channel)
        cases = [
            (vllm_pb2.GenerateRequest(text="hi", sampling_params=vllm_pb2.SamplingParams(
                temperature=-1)), "sampling_params.temperature"),
            (vllm_pb2.GenerateRequest(tokenized=vllm_pb2.TokenizedInput(input_ids=[5, 9999])),
             "tokenized.input_ids"),
            (vllm_pb2.GenerateRequest(tokenized=vllm_pb2.TokenizedInput()),
             "tokenized.input_ids"),
            (vllm_pb2.GenerateRequest(text="hi", sampling_params=vllm_pb2.SamplingParams(
                max_tokens=MAX_MODEL_LEN)), "sampling_params.max_tokens"),
            (vllm_pb2.GenerateRequest(text="hi", mm_inputs=vllm_pb2.MultimodalInputs(
                mm_hashes=["x"])), "mm_inputs"),
            (vllm_pb2.GenerateRequest(text="hi", data_parallel_rank=7), "data_parallel_rank"),
            (vllm_pb2.GenerateRequest(), "input"),
        ]
        for request, field in cases:
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await collect(stub, request)
            assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT, field
            assert bad_field(info.value) == field
            assert field in (info.value.details() or "")

    serve_generate(tokenizer, model_info, FakeEngine(script(tokenizer)), body)


def test_abort_by_request_id_completes_with_abort(tokenizer: TextTokenizer,
                                                  model_info: ModelInfo) -> None:
    engine = FakeEngine(script(tokenizer), step_s=0.2)

    async def body(_: pb_grpc.GenerateServiceStub, channel: grpc.aio.Channel) -> None:
        stub = vllm_grpc.VllmEngineStub(channel)
        call = stub.Generate(vllm_pb2.GenerateRequest(
            request_id="long", text=TEXT, stream=True,
            sampling_params=vllm_pb2.SamplingParams(ignore_eos=True)))
        first = await anext(aiter(call))
        assert first.WhichOneof("response") == "chunk"
        engine.frozen = True  # it cannot finish the request first, however slow we are
        await stub.Abort(vllm_pb2.AbortRequest(request_ids=["long", "unknown"]))
        rest = [r async for r in call]
        assert rest[-1].complete.finish_reason == "abort"
        await asyncio.wait_for(engine.aborted.wait(), 5)
        assert "long" in engine.aborts

    serve_generate(tokenizer, model_info, engine, body)


def test_a_client_that_goes_away_aborts_the_engine_request(
        tokenizer: TextTokenizer, model_info: ModelInfo) -> None:
    engine = FakeEngine(script(tokenizer), step_s=0.2)

    async def body(_: pb_grpc.GenerateServiceStub, channel: grpc.aio.Channel) -> None:
        call = vllm_grpc.VllmEngineStub(channel).Generate(vllm_pb2.GenerateRequest(
            request_id="gone", text=TEXT, stream=True))
        await anext(aiter(call))
        engine.frozen = True
        call.cancel()
        await asyncio.wait_for(engine.aborted.wait(), 5)
        assert engine.aborts == ["gone"]

    serve_generate(tokenizer, model_info, engine, body)


def test_state_rpcs_answer_from_the_frontend(tokenizer: TextTokenizer,
                                             model_info: ModelInfo) -> None:
    engine = FakeEngine(script(tokenizer))

    async def body(_: pb_grpc.GenerateServiceStub, channel: grpc.aio.Channel) -> None:
        stub = vllm_grpc.VllmEngineStub(channel)
        health = await stub.HealthCheck(vllm_pb2.HealthCheckRequest())
        assert health.healthy
        info = await stub.GetModelInfo(vllm_pb2.GetModelInfoRequest())
        assert (info.vocab_size, info.max_context_length, info.is_generation) == (
            model_info.vocab_size, MAX_MODEL_LEN, True)
        assert list(info.eos_token_ids) == [EOS_ID] and info.max_req_input_len == MAX_MODEL_LEN - 1
        loads = await stub.GetLoads(vllm_pb2.GetLoadsRequest())
        assert loads.dp_rank_count == 1 and loads.version.startswith("corestream")
        with pytest.raises(grpc.aio.AioRpcError) as error:
            await stub.GetLoads(vllm_pb2.GetLoadsRequest(dp_rank=5))
        assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        server = await stub.GetServerInfo(vllm_pb2.GetServerInfoRequest())
        assert server.server_type == "vllm-grpc" and server.data_parallel_size == 1
        assert not server.is_paused
        assert server.block_size == 16  # from the engine's cache snapshot
        # The test model has no folder: no tokenizer to bundle.
        with pytest.raises(grpc.aio.AioRpcError) as error:
            [c async for c in stub.GetTokenizer(smg_pb2.GetTokenizerRequest())]
        assert error.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        with pytest.raises(grpc.aio.AioRpcError) as error:
            await stub.Embed(vllm_pb2.EmbedRequest(
                tokenized=vllm_pb2.TokenizedInput(input_ids=[5, 6])))
        assert error.value.code() == grpc.StatusCode.FAILED_PRECONDITION  # not a pooler
        with pytest.raises(grpc.aio.AioRpcError) as error:
            await stub.StartProfile(smg_pb2.StartProfileRequest(output_dir="/tmp/x"))
        assert bad_field(error.value) == "output_dir"
        # Health and reflection list the service.
        status = await health_pb2_grpc.HealthStub(channel).Check(
            health_pb2.HealthCheckRequest(service=SERVICE_NAME))
        assert status.status == health_pb2.HealthCheckResponse.SERVING
        reflection = reflection_pb2_grpc.ServerReflectionStub(channel)
        async for answer in reflection.ServerReflectionInfo(iter(
                [reflection_pb2.ServerReflectionRequest(list_services="")])):
            listed = {s.name for s in answer.list_services_response.service}
            assert SERVICE_NAME in listed

    serve_generate(tokenizer, model_info, engine, body, routing_policy="least_load")
    # Least-load routing needs no cache events; the vLLM API's subscribers do.
    assert [h.kv_cache_events for h in engine.hellos] == [True]


def test_the_flag_turns_the_api_and_the_subscription_off(
        tokenizer: TextTokenizer, model_info: ModelInfo) -> None:
    engine = FakeEngine(script(tokenizer))

    async def body(_: pb_grpc.GenerateServiceStub, channel: grpc.aio.Channel) -> None:
        with pytest.raises(grpc.aio.AioRpcError) as error:
            await vllm_grpc.VllmEngineStub(channel).HealthCheck(vllm_pb2.HealthCheckRequest())
        assert error.value.code() == grpc.StatusCode.UNIMPLEMENTED

    serve_generate(tokenizer, model_info, engine, body, routing_policy="least_load",
                   vllm_grpc=False)
    assert [h.kv_cache_events for h in engine.hellos] == [False]


def test_operator_calls_need_an_admin_key(tokenizer: TextTokenizer, model_info: ModelInfo,
                                          tmp_path: Path) -> None:
    (tmp_path / "api").write_text("user-key\n")
    (tmp_path / "admin").write_text("admin-key\n")
    user = (("authorization", "Bearer user-key"),)

    async def body(_: pb_grpc.GenerateServiceStub, channel: grpc.aio.Channel) -> None:
        stub = vllm_grpc.VllmEngineStub(channel)
        health = await stub.HealthCheck(vllm_pb2.HealthCheckRequest(), metadata=user)
        assert health.healthy
        for call in (stub.FlushCache(smg_pb2.FlushCacheRequest(), metadata=user),
                     stub.StartProfile(smg_pb2.StartProfileRequest(), metadata=user),
                     stub.StopProfile(smg_pb2.StopProfileRequest(), metadata=user)):
            with pytest.raises(grpc.aio.AioRpcError) as error:
                await call
            assert error.value.code() == grpc.StatusCode.PERMISSION_DENIED
            assert "needs an admin key" in (error.value.details() or "")
        with pytest.raises(grpc.aio.AioRpcError) as error:
            await stub.GetLoads(vllm_pb2.GetLoadsRequest())
        assert error.value.code() == grpc.StatusCode.UNAUTHENTICATED

    serve_generate(tokenizer, model_info, FakeEngine(script(tokenizer)), body,
                   api_key_file=str(tmp_path / "api"),
                   admin_api_key_file=str(tmp_path / "admin"))
