"""The frontend's spans, metrics and request ids, in-process against a scripted engine."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

import grpc
import pytest
from corestream.common.v1 import common_pb2
from corestream.generate.v1 import generate_service_pb2 as pb
from corestream.generate.v1 import generate_service_pb2_grpc as pb_grpc
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from services.common.model_info import ModelInfo
from services.common.observability import Observability
from services.common.observability_config import ObservabilityConfig
from services.frontend.config import FrontendConfig
from services.frontend.server import FrontendServer
from services.frontend.tokenizer import TextTokenizer
from tests.unit.frontend.fakes import EOS_ID, FakeEngine, start_fake_engine

TEXT = "hello world"
TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
CLIENT_SPAN = "00f067aa0ba902b7"
TRACEPARENT = f"00-{TRACE_ID}-{CLIENT_SPAN}-01"

Body = Callable[[pb_grpc.GenerateServiceStub], Awaitable[None]]


def _serve(tokenizer: TextTokenizer, model_info: ModelInfo, engine: FakeEngine,
           observability: Observability, body: Body) -> None:
    async def main() -> None:
        engine_server, address = await start_fake_engine(engine)
        config = FrontendConfig(port=0, engines=(address,))
        frontend = FrontendServer(config, tokenizer, model_info, observability=observability)
        port = await frontend.start()
        try:
            async with asyncio.timeout(10):
                while not frontend.balancer.ready:
                    await asyncio.sleep(0.01)
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
                await body(pb_grpc.GenerateServiceStub(channel))
        finally:
            await frontend.stop(0)
            await engine_server.stop(0)

    asyncio.run(main())


def _observability(exporter: InMemorySpanExporter | None = None,
                   include_content: bool = False) -> Observability:
    config = ObservabilityConfig(trace_include_content=include_content)
    return Observability("frontend", config, "127.0.0.1", exporter=exporter)


def _request(**sampling: object) -> pb.GenerateStreamRequest:
    return pb.GenerateStreamRequest(
        text="hi", sampling=common_pb2.SamplingParams(temperature=0, **sampling))


@pytest.mark.timeout(60)
def test_without_tracing_the_clients_traceparent_reaches_the_engine_unchanged(
        tokenizer: TextTokenizer, model_info: ModelInfo) -> None:
    engine = FakeEngine(tokenizer.encode(TEXT, add_special_tokens=False) + [EOS_ID])

    async def body(stub: pb_grpc.GenerateServiceStub) -> None:
        call = stub.GenerateStream(_request(), metadata=(
            ("traceparent", TRACEPARENT), ("tracestate", "vendor=1"),
            ("x-request-id", "client-id-1")))
        chunks = [c async for c in call]
        assert dict(await call.initial_metadata())["x-request-id"] == "client-id-1"
        assert {c.request_id for c in chunks} == {"client-id-1"}

    obs = _observability()
    _serve(tokenizer, model_info, engine, obs, body)
    (add,) = engine.adds
    assert dict(add.trace_headers) == {"traceparent": TRACEPARENT, "tracestate": "vendor=1"}
    assert obs.registry.get_sample_value(
        "corestream:request_success_total",
        {"model_name": model_info.name, "engine": "0", "finished_reason": "stop"}) == 1
    assert obs.registry.get_sample_value(
        "corestream:routed_requests_total",
        {"model_name": model_info.name, "policy": "cache_aware", "prefix_hit": "false"}) == 1
    # The fake engine has no cache to publish, yet says it served 2 cached tokens.
    assert [obs.registry.get_sample_value(f"corestream:routing_{kind}_cached_tokens_total",
                                          {"model_name": model_info.name})
            for kind in ("predicted", "actual")] == [0, 2]


@pytest.mark.timeout(60)
def test_spans_continue_the_clients_trace_and_the_engine_continues_ours(
        tokenizer: TextTokenizer, model_info: ModelInfo) -> None:
    engine = FakeEngine(tokenizer.encode(TEXT, add_special_tokens=False) + [EOS_ID])
    exporter = InMemorySpanExporter()

    async def body(stub: pb_grpc.GenerateServiceStub) -> None:
        call = stub.GenerateStream(_request(max_tokens=50), metadata=(
            ("traceparent", TRACEPARENT),))
        assert [c async for c in call]

    obs = _observability(exporter)
    _serve(tokenizer, model_info, engine, obs, body)
    assert obs.tracing.provider is not None
    obs.tracing.provider.force_flush()
    spans = {s.name: s for s in exporter.get_finished_spans()}
    rpc = spans["/corestream.generate.v1.GenerateService/GenerateStream"]
    assert format(rpc.parent.span_id, "016x") == CLIENT_SPAN
    request = spans[f"text_completion {model_info.name}"]
    assert format(request.context.trace_id, "032x") == TRACE_ID
    assert request.parent.span_id == rpc.context.span_id
    for phase in ("validate", "tokenize", "route", "detokenize"):
        assert spans[phase].parent.span_id == request.context.span_id
    # The route span says which engine was chosen and why.
    route = spans["route"].attributes
    assert route["corestream.route.policy"] == "cache_aware"
    assert route["corestream.route.reason"].startswith("least_load: no engine holds")
    assert route["corestream.route.predicted_cached_tokens"] == 0
    assert ":" in route["corestream.route.engine"]
    attrs = request.attributes
    assert attrs["gen_ai.request.max_tokens"] == 50
    assert attrs["gen_ai.request.temperature"] == 0
    assert attrs["gen_ai.response.finish_reasons"] == ("stop",)
    assert attrs["gen_ai.usage.output_tokens"] == len(engine.script)
    assert "gen_ai.prompt" not in attrs
    # The engine's add carries our request span, not the client's.
    (add,) = engine.adds
    _, trace_id, parent, _ = add.trace_headers["traceparent"].split("-")
    assert (trace_id, parent) == (TRACE_ID, format(request.context.span_id, "016x"))


@pytest.mark.timeout(60)
def test_content_is_recorded_only_when_enabled(tokenizer: TextTokenizer,
                                               model_info: ModelInfo) -> None:
    engine = FakeEngine(tokenizer.encode(TEXT, add_special_tokens=False) + [EOS_ID])
    exporter = InMemorySpanExporter()

    async def body(stub: pb_grpc.GenerateServiceStub) -> None:
        assert [c async for c in stub.GenerateStream(_request())]

    obs = _observability(exporter, include_content=True)
    _serve(tokenizer, model_info, engine, obs, body)
    assert obs.tracing.provider is not None
    obs.tracing.provider.force_flush()
    (request,) = [s for s in exporter.get_finished_spans() if s.name.startswith("text_")]
    assert request.attributes["gen_ai.prompt"] == "hi"
    assert request.attributes["gen_ai.completion"] == (TEXT,)


@pytest.mark.timeout(60)
def test_rejections_count_by_code_and_field(tokenizer: TextTokenizer,
                                            model_info: ModelInfo) -> None:
    engine = FakeEngine([EOS_ID])

    async def body(stub: pb_grpc.GenerateServiceStub) -> None:
        with pytest.raises(grpc.aio.AioRpcError) as error:
            async for _ in stub.GenerateStream(_request(top_p=2.0)):
                pass
        assert error.value.code() is grpc.StatusCode.INVALID_ARGUMENT

    obs = _observability()
    _serve(tokenizer, model_info, engine, obs, body)
    samples = [(s.labels, s.value) for m in obs.registry.collect()
               if m.name == "corestream:requests_rejected" for s in m.samples
               if s.name.endswith("_total")]
    assert samples == [({"model_name": model_info.name, "code": "INVALID_ARGUMENT",
                         "reason": "sampling.top_p"}, 1.0)]
    assert obs.registry.get_sample_value(
        "corestream:grpc_server_handled_total",
        {"grpc_service": "corestream.generate.v1.GenerateService",
         "grpc_method": "GenerateStream", "grpc_code": "INVALID_ARGUMENT"}) == 1
