"""The frontend in-process against a scripted engine on 127.0.0.1."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import grpc
import pytest
from corestream.common.v1 import common_pb2
from corestream.coordinator.v1 import coordinator_service_pb2 as coordinator_pb2
from corestream.coordinator.v1 import coordinator_service_pb2_grpc as coordinator_pb2_grpc
from corestream.generate.v1 import generate_service_pb2 as pb
from corestream.generate.v1 import generate_service_pb2_grpc as pb_grpc
from google.rpc import error_details_pb2
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_status import rpc_status

from services.common.model_info import ModelInfo
from services.frontend.config import FrontendConfig
from services.frontend.generate_service import SERVICE_NAME
from services.frontend.main import event_loop_factory
from services.frontend.server import FrontendServer
from services.frontend.tokenizer import TextTokenizer
from tests.unit.frontend.fakes import (
    EOS_ID,
    MAX_MODEL_LEN,
    TEXT,
    FakeEngine,
    script,
    serve_generate,
    start_fake_engine,
)


async def _readiness(channel: grpc.aio.Channel) -> int:
    health = health_pb2_grpc.HealthStub(channel)
    response = await health.Check(health_pb2.HealthCheckRequest(service=SERVICE_NAME))
    return response.status


@pytest.mark.timeout(60)
@pytest.mark.parametrize("event_loop", ["asyncio", "uvloop"])  # `corestream frontend` runs uvloop
def test_stream_detokenizes_and_reports_usage(
    tokenizer: TextTokenizer, model_info: ModelInfo, event_loop: str
) -> None:
    engine = FakeEngine(script(tokenizer))

    async def body(stub: pb_grpc.GenerateServiceStub, channel: grpc.aio.Channel) -> None:
        assert await _readiness(channel) == health_pb2.HealthCheckResponse.SERVING
        call = stub.GenerateStream(
            pb.GenerateStreamRequest(
                text="hello", sampling=common_pb2.SamplingParams(temperature=0)
            )
        )
        chunks = [chunk async for chunk in call]
        metadata = dict(await call.initial_metadata())
        assert await call.code() == grpc.StatusCode.OK
        assert chunks[0].request_id and metadata["x-request-id"] == chunks[0].request_id
        assert "".join(c.text for c in chunks) == TEXT
        assert [t for c in chunks for t in c.token_ids] == engine.script
        last = chunks[-1]
        assert last.finish_reason == common_pb2.FINISH_REASON_EOS_TOKEN
        prompt = tokenizer.encode("hello")
        assert last.usage == common_pb2.Usage(
            prompt_tokens=len(prompt), completion_tokens=len(engine.script), cached_tokens=2
        )
        assert all(not c.finish_reason for c in chunks[:-1])
        (add,) = engine.adds
        assert list(add.prompt_token_ids) == prompt and prompt[0] == 0  # BOS added
        assert list(add.eos_token_ids) == [EOS_ID]
        assert add.sampling.max_tokens == MAX_MODEL_LEN - len(prompt)
        assert len(engine.hellos) == 1 and engine.hellos[0].frontend_id

    serve_generate(tokenizer, model_info, engine, body, event_loop)


def test_event_loop_choices() -> None:
    import uvloop

    assert event_loop_factory("asyncio") is None
    assert event_loop_factory("auto") is uvloop.new_event_loop
    assert event_loop_factory("uvloop") is uvloop.new_event_loop
    with pytest.raises(ValueError, match="event_loop must be one of"):
        FrontendConfig(event_loop="trio")


@pytest.mark.timeout(60)
def test_stop_string_trims_text_and_aborts_engine(
    tokenizer: TextTokenizer, model_info: ModelInfo
) -> None:
    engine = FakeEngine(script(tokenizer))

    async def body(stub: pb_grpc.GenerateServiceStub, channel: grpc.aio.Channel) -> None:
        request = pb.GenerateStreamRequest(
            request_id="stop-me",
            token_ids=pb.TokenIds(ids=[0, 5]),
            sampling=common_pb2.SamplingParams(stop=["quick"]),
        )
        chunks = [chunk async for chunk in stub.GenerateStream(request)]
        assert "".join(c.text for c in chunks) == "hello world, the "
        assert chunks[-1].finish_reason == common_pb2.FINISH_REASON_STOP_STRING
        assert chunks[-1].stop_string == "quick"
        await asyncio.wait_for(engine.aborted.wait(), 5)
        assert engine.aborts == ["stop-me"]

    serve_generate(tokenizer, model_info, engine, body)


@pytest.mark.timeout(60)
def test_unary_generate_length_and_stop_token(
    tokenizer: TextTokenizer, model_info: ModelInfo
) -> None:
    engine = FakeEngine(script(tokenizer))

    async def body(stub: pb_grpc.GenerateServiceStub, channel: grpc.aio.Channel) -> None:
        response = await stub.Generate(
            pb.GenerateRequest(text="hi", sampling=common_pb2.SamplingParams(max_tokens=3))
        )
        (completion,) = response.completions
        assert completion.finish_reason == common_pb2.FINISH_REASON_LENGTH
        assert list(completion.token_ids) == engine.script[:3]
        assert completion.text == tokenizer.decode(engine.script[:3])
        assert response.usage.completion_tokens == 3
        stop_id = engine.script[2]
        response = await stub.Generate(
            pb.GenerateRequest(
                text="hi", sampling=common_pb2.SamplingParams(stop_token_ids=[stop_id])
            )
        )
        assert response.completions[0].finish_reason == common_pb2.FINISH_REASON_STOP_TOKEN
        assert response.completions[0].stop_token_id == stop_id

    serve_generate(tokenizer, model_info, engine, body)


@pytest.mark.timeout(60)
def test_client_cancel_aborts_in_engine(tokenizer: TextTokenizer, model_info: ModelInfo) -> None:
    engine = FakeEngine(script(tokenizer), step_s=0.1)

    async def body(stub: pb_grpc.GenerateServiceStub, channel: grpc.aio.Channel) -> None:
        call = stub.GenerateStream(pb.GenerateStreamRequest(request_id="gone", text="hello"))
        await call.read()
        call.cancel()
        await asyncio.wait_for(engine.aborted.wait(), 5)
        assert engine.aborts == ["gone"]

    serve_generate(tokenizer, model_info, engine, body)


@pytest.mark.timeout(60)
def test_deadline_aborts_in_engine(tokenizer: TextTokenizer, model_info: ModelInfo) -> None:
    engine = FakeEngine(script(tokenizer), step_s=0.1)

    async def body(stub: pb_grpc.GenerateServiceStub, channel: grpc.aio.Channel) -> None:
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await stub.Generate(pb.GenerateRequest(request_id="late", text="hello"), timeout=0.3)
        assert info.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        await asyncio.wait_for(engine.aborted.wait(), 5)
        assert engine.aborts == ["late"]

    serve_generate(tokenizer, model_info, engine, body)


@pytest.mark.timeout(60)
def test_abort_rpc_and_duplicate_ids(tokenizer: TextTokenizer, model_info: ModelInfo) -> None:
    engine = FakeEngine(script(tokenizer), step_s=0.1)

    async def body(stub: pb_grpc.GenerateServiceStub, channel: grpc.aio.Channel) -> None:
        call = stub.GenerateStream(pb.GenerateStreamRequest(request_id="r1", text="hello"))
        await call.read()
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await stub.Generate(pb.GenerateRequest(request_id="r1", text="hello"))
        assert info.value.code() == grpc.StatusCode.ALREADY_EXISTS
        response = await stub.Abort(pb.AbortRequest(request_ids=["r1", "unknown"]))
        assert list(response.aborted_request_ids) == ["r1"]
        rest = []
        while (chunk := await call.read()) is not grpc.aio.EOF:
            rest.append(chunk)
        assert rest[-1].finish_reason == common_pb2.FINISH_REASON_ABORT
        assert await call.code() == grpc.StatusCode.OK
        # The stream ends at once; the abort reaches the engine over its Session
        # meanwhile (a loaded run that looked at once found it not there yet).
        await asyncio.wait_for(engine.aborted.wait(), 5)
        assert "r1" in engine.aborts

    serve_generate(tokenizer, model_info, engine, body)


@pytest.mark.timeout(60)
def test_invalid_requests_carry_field_violations(
    tokenizer: TextTokenizer, model_info: ModelInfo
) -> None:
    engine = FakeEngine(script(tokenizer))

    async def body(stub: pb_grpc.GenerateServiceStub, channel: grpc.aio.Channel) -> None:
        cases = [
            (pb.GenerateRequest(text="hi", sampling=common_pb2.SamplingParams(temperature=-1)),
             "sampling.temperature", "sampling.temperature must be >= 0, got -1"),
            (pb.GenerateRequest(), "text", "prompt is empty"),
            (pb.GenerateRequest(token_ids=pb.TokenIds(ids=[1] * MAX_MODEL_LEN)),
             "prompt", "max_model_len"),
        ]
        for request, field, message in cases:
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await stub.Generate(request)
            error = info.value
            assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert message in error.details()
            status = rpc_status.from_call(error)  # type: ignore[arg-type]
            assert status is not None
            bad_request = error_details_pb2.BadRequest()
            assert status.details[0].Unpack(bad_request)
            assert bad_request.field_violations[0].field == field
        assert engine.adds == []

    serve_generate(tokenizer, model_info, engine, body)


@pytest.mark.timeout(60)
def test_engine_error_and_death_become_statuses(
    tokenizer: TextTokenizer, model_info: ModelInfo
) -> None:
    engine = FakeEngine(script(tokenizer))

    async def body(stub: pb_grpc.GenerateServiceStub, channel: grpc.aio.Channel) -> None:
        engine.error = (grpc.StatusCode.RESOURCE_EXHAUSTED.value[0], "KV cache is full")
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await stub.Generate(pb.GenerateRequest(text="hi"))
        assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert info.value.details() == "KV cache is full"
        engine.error = None
        engine.final_state = common_pb2.ENGINE_STATE_DEAD
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await stub.Generate(pb.GenerateRequest(text="hi"))
        assert info.value.code() == grpc.StatusCode.UNAVAILABLE
        assert "fake engine is dead (scripted)" in info.value.details()
        assert "engine-core dp=0 at 127.0.0.1:" in info.value.details()
        # The client reconnects to the (still listening) engine.
        engine.final_state = None
        async with asyncio.timeout(10):
            while len(engine.hellos) < 2:
                await asyncio.sleep(0.02)
            while True:
                try:
                    response = await stub.Generate(pb.GenerateRequest(text="hi"))
                    break
                except grpc.aio.AioRpcError as e:
                    assert e.code() == grpc.StatusCode.UNAVAILABLE
                    await asyncio.sleep(0.05)
        assert response.completions[0].finish_reason == common_pb2.FINISH_REASON_EOS_TOKEN

    serve_generate(tokenizer, model_info, engine, body)


@pytest.mark.timeout(60)
def test_no_engine_is_unavailable(tokenizer: TextTokenizer, model_info: ModelInfo) -> None:
    async def body(stub: pb_grpc.GenerateServiceStub, channel: grpc.aio.Channel) -> None:
        assert await _readiness(channel) == health_pb2.HealthCheckResponse.NOT_SERVING
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await stub.Generate(pb.GenerateRequest(text="hi"))
        assert info.value.code() == grpc.StatusCode.UNAVAILABLE
        assert "no engine is available" in info.value.details()
        model = await stub.GetModelInfo(pb.GetModelInfoRequest())
        assert model.num_engines == 0 and model.tensor_parallel_size == 0

    serve_generate(tokenizer, model_info, None, body)


@pytest.mark.timeout(60)
def test_tokenize_detokenize_model_info(tokenizer: TextTokenizer, model_info: ModelInfo) -> None:
    engine = FakeEngine([])

    async def body(stub: pb_grpc.GenerateServiceStub, channel: grpc.aio.Channel) -> None:
        tokens = await stub.Tokenize(pb.TokenizeRequest(text="hello world"))
        assert list(tokens.token_ids) == tokenizer.encode("hello world")
        assert tokens.tokens[0] == "<s>" and len(tokens.tokens) == len(tokens.token_ids)
        plain = await stub.Tokenize(pb.TokenizeRequest(text="hello", add_special_tokens=False))
        assert plain.token_ids[0] != 0
        text = await stub.Detokenize(pb.DetokenizeRequest(token_ids=tokens.token_ids))
        assert text.text == "hello world"
        raw = await stub.Detokenize(
            pb.DetokenizeRequest(token_ids=tokens.token_ids, skip_special_tokens=False)
        )
        assert raw.text == "<s>hello world"
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await stub.Detokenize(pb.DetokenizeRequest(token_ids=[10_000]))
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        model = await stub.GetModelInfo(pb.GetModelInfoRequest())
        assert model.model == "served-name"
        assert model.max_context_length == MAX_MODEL_LEN and model.vocab_size == 300
        assert list(model.eos_token_ids) == [EOS_ID] and model.bos_token_id == 0
        assert model.num_engines == 1 and list(model.architectures) == ["LlamaForCausalLM"]
        assert model.tensor_parallel_size == 0  # a static engine list does not tell it

    serve_generate(tokenizer, model_info, engine, body, served_model_name="served-name")


@pytest.mark.timeout(60)
def test_a_request_whose_engine_dies_before_any_output_runs_elsewhere(
    tokenizer: TextTokenizer, model_info: ModelInfo
) -> None:
    async def main() -> None:
        dying, healthy = FakeEngine(script(tokenizer)), FakeEngine(script(tokenizer))
        servers = [await start_fake_engine(e) for e in (dying, healthy)]
        frontend = FrontendServer(
            FrontendConfig(port=0, engines=tuple(a for _, a in servers),
                           routing_policy="round_robin"), tokenizer, model_info)
        port = await frontend.start()
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
                async with asyncio.timeout(10):
                    while frontend.balancer.num_connected < 2:
                        await asyncio.sleep(0.02)
                stub = pb_grpc.GenerateServiceStub(channel)
                dying.die_on_add = True
                # Round robin sends the first to the dying engine (the second too if its
                # Session is back by then): both succeed, on the healthy one.
                for _ in range(2):
                    response = await stub.Generate(pb.GenerateRequest(text="hello"))
                    assert response.completions[0].text == TEXT
                assert len(healthy.adds) == 2 and 1 <= len(dying.adds) <= 2
                # Once a token has arrived the request is not replayed: it fails.
                dying.die_on_add = False
                healthy.final_state = common_pb2.ENGINE_STATE_DEAD
                async with asyncio.timeout(10):
                    while frontend.balancer.num_connected < 2:
                        await asyncio.sleep(0.02)
                codes = set()
                for _ in range(2):
                    try:
                        await stub.Generate(pb.GenerateRequest(text="hello"))
                        codes.add(grpc.StatusCode.OK)
                    except grpc.aio.AioRpcError as e:
                        codes.add(e.code())
                assert codes == {grpc.StatusCode.OK, grpc.StatusCode.UNAVAILABLE}
        finally:
            await frontend.stop(0)
            for server, _ in servers:
                await server.stop(0)

    asyncio.run(main())


class _Coordinator(coordinator_pb2_grpc.CoordinatorServiceServicer):
    def __init__(self, address: str) -> None:
        self.address = address

    async def WatchLoad(
        self, request: coordinator_pb2.WatchLoadRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[coordinator_pb2.WatchLoadResponse]:
        yield coordinator_pb2.WatchLoadResponse(
            generation=1,
            engines=[
                coordinator_pb2.EngineLoad(
                    address=self.address, state=common_pb2.ENGINE_STATE_RUNNING,
                    tensor_parallel_size=2,
                )
            ],
        )
        await asyncio.Event().wait()  # a live stream with no further changes


@pytest.mark.timeout(60)
def test_engines_learned_from_coordinator(
    tokenizer: TextTokenizer, model_info: ModelInfo
) -> None:
    async def main() -> None:
        engine = FakeEngine(script(tokenizer))
        engine_server, engine_address = await start_fake_engine(engine)
        coordinator = grpc.aio.server()
        coordinator_pb2_grpc.add_CoordinatorServiceServicer_to_server(
            _Coordinator(engine_address), coordinator
        )
        coordinator_port = coordinator.add_insecure_port("127.0.0.1:0")
        await coordinator.start()
        frontend = FrontendServer(
            FrontendConfig(port=0, coordinator=f"127.0.0.1:{coordinator_port}"),
            tokenizer,
            model_info,
        )
        port = await frontend.start()
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
                async with asyncio.timeout(10):
                    while await _readiness(channel) != health_pb2.HealthCheckResponse.SERVING:
                        await asyncio.sleep(0.02)
                stub = pb_grpc.GenerateServiceStub(channel)
                response = await stub.Generate(pb.GenerateRequest(text="hello"))
                assert response.completions[0].text == TEXT
                model = await stub.GetModelInfo(pb.GetModelInfoRequest())
                assert model.num_engines == 1 and model.tensor_parallel_size == 2
        finally:
            await frontend.stop(0)
            await coordinator.stop(0)
            await engine_server.stop(0)

    asyncio.run(main())


@pytest.mark.timeout(60)
def test_frozen_engine_trips_the_watchdog(tokenizer: TextTokenizer, model_info: ModelInfo) -> None:
    engine = FakeEngine(script(tokenizer, eos=False) * 50, step_s=0.05)
    timeout_s = 3.0

    async def body(stub: pb_grpc.GenerateServiceStub, channel: grpc.aio.Channel) -> None:
        # Idle for longer than the timeout: nothing in flight, nothing trips.
        await asyncio.sleep(timeout_s + 0.5)
        assert await _readiness(channel) == health_pb2.HealthCheckResponse.SERVING
        stream = stub.GenerateStream(pb.GenerateStreamRequest(text="hi"))
        await stream.read()
        engine.frozen = True  # SIGSTOP, as far as the frontend can tell
        frozen_at = asyncio.get_running_loop().time()
        with pytest.raises(grpc.aio.AioRpcError) as info:
            while await stream.read() is not grpc.aio.EOF:
                pass
        detected_s = asyncio.get_running_loop().time() - frozen_at
        print(f"frozen engine detected after {detected_s:.2f} s (timeout {timeout_s:g} s)")
        assert info.value.code() == grpc.StatusCode.UNAVAILABLE
        assert "watchdog" in info.value.details() and "dp=0" in info.value.details()
        assert timeout_s <= detected_s < timeout_s + 2
        # The frozen engine answers no new Session: it takes no requests.
        assert await _readiness(channel) == health_pb2.HealthCheckResponse.NOT_SERVING
        engine.frozen = False

    serve_generate(tokenizer, model_info, engine, body, watchdog_timeout=timeout_s)


@pytest.mark.timeout(60)
def test_drain_refuses_new_then_ends_the_rest(
    tokenizer: TextTokenizer, model_info: ModelInfo
) -> None:
    async def main() -> None:
        engine = FakeEngine(script(tokenizer, eos=False) * 100, step_s=0.05)
        engine_server, address = await start_fake_engine(engine)
        frontend = FrontendServer(FrontendConfig(port=0, engines=(address,)), tokenizer,
                                  model_info)
        port = await frontend.start()
        try:
            async with asyncio.timeout(10):
                while not frontend.balancer.ready:
                    await asyncio.sleep(0.01)
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
                stub = pb_grpc.GenerateServiceStub(channel)
                short = stub.Generate(pb.GenerateRequest(
                    text="hi", sampling=common_pb2.SamplingParams(max_tokens=5)))
                long = stub.GenerateStream(pb.GenerateStreamRequest(text="hi"))
                await long.read()
                stopping = asyncio.create_task(frontend.stop(1.0))
                await asyncio.sleep(0.1)
                assert await _readiness(channel) == health_pb2.HealthCheckResponse.NOT_SERVING
                with pytest.raises(grpc.aio.AioRpcError) as refused:
                    await stub.Generate(pb.GenerateRequest(text="hi"))
                assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
                assert "draining" in refused.value.details()
                assert (await short).completions[0].finish_reason  # finished within the drain
                with pytest.raises(grpc.aio.AioRpcError) as ended:
                    while await long.read() is not grpc.aio.EOF:
                        pass
                assert ended.value.code() == grpc.StatusCode.UNAVAILABLE
                assert "shutting down" in ended.value.details()
                await stopping
                assert engine.aborts  # the engine stopped working on it
        finally:
            await frontend.stop(0)
            await engine_server.stop(0)

    asyncio.run(main())
