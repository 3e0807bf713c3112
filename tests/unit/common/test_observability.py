"""ObservabilityConfig, JSON logs, the metrics endpoint, gRPC call metrics, tracing."""

from __future__ import annotations

import argparse
import asyncio
import io
import json
import logging
import time
import urllib.request
from collections.abc import Iterator
from concurrent import futures

import grpc
import pytest
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from prometheus_client.parser import text_string_to_metric_families

from services.common.config import add_arguments, from_args
from services.common.logs import JsonFormatter, request_context
from services.common.metrics import ConfigInfo, new_registry, serve_metrics
from services.common.metrics_grpc import GrpcMetrics
from services.common.observability_config import ObservabilityConfig
from services.common.tracing import SHUTDOWN_TIMEOUT_S, Tracing, extract, inject

TRACEPARENT = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"


# ---- config ------------------------------------------------------------------


@pytest.mark.parametrize("kwargs, message", [
    ({"metrics_port": 70000}, "metrics_port must be in [0, 65535]"),
    ({"trace_sample_ratio": 1.5}, "trace_sample_ratio must be in [0, 1]"),
    ({"trace_sample_ratio": float("nan")}, "trace_sample_ratio must be in [0, 1]"),
    ({"log_format": "xml"}, "log_format must be one of"),
    ({"otlp_endpoint": "collector"}, "otlp_endpoint must be host:port"),
])
def test_config_names_the_field_and_the_limit(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message.replace("[", r"\[").replace("]", r"\]")):
        ObservabilityConfig(**kwargs)


def test_every_field_is_a_flag() -> None:
    parser = argparse.ArgumentParser()
    add_arguments(parser, ObservabilityConfig)
    args = parser.parse_args(["--metrics-port", "9100", "--otlp-endpoint", "otel:4317",
                              "--trace-sample-ratio", "0.25", "--trace-include-content",
                              "--log-format", "json", "--metrics-host", "0.0.0.0"])
    assert from_args(ObservabilityConfig, args) == ObservabilityConfig(
        metrics_port=9100, metrics_host="0.0.0.0", otlp_endpoint="otel:4317",
        trace_sample_ratio=0.25, trace_include_content=True, log_format="json")


# ---- logs --------------------------------------------------------------------


def _json_log(emit: callable) -> dict:
    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    handler.setFormatter(JsonFormatter("frontend"))
    logger = logging.getLogger("test.observability.json")
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    try:
        emit(logger)
    finally:
        logger.removeHandler(handler)
    lines = stream.getvalue().splitlines()
    assert len(lines) == 1  # one line per event
    return json.loads(lines[0])


def test_json_log_has_the_request_and_trace_ids() -> None:
    exporter = InMemorySpanExporter()
    tracing = Tracing("frontend", ObservabilityConfig(), exporter=exporter)
    with tracing.tracer.start_as_current_span("request") as span, request_context("req-7"):
        entry = _json_log(lambda log: log.info("finished %d tokens", 5))
    ctx = span.get_span_context()
    assert entry["message"] == "finished 5 tokens"
    assert entry["request_id"] == "req-7"
    assert entry["trace_id"] == format(ctx.trace_id, "032x")
    assert entry["span_id"] == format(ctx.span_id, "016x")
    assert entry["service"] == "frontend" and entry["level"] == "INFO"


def test_json_log_without_a_request_has_no_ids_and_keeps_exceptions() -> None:
    def emit(log: logging.Logger) -> None:
        try:
            raise RuntimeError("boom")
        except RuntimeError:
            log.exception("failed", extra={"request_id": "from-extra"})

    entry = _json_log(emit)
    assert "trace_id" not in entry
    assert entry["request_id"] == "from-extra"
    assert "RuntimeError: boom" in entry["exception"]


# ---- metrics endpoint ----------------------------------------------------------


def _scrape(port: int) -> dict[tuple[str, frozenset], float]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as response:
        text = response.read().decode()
    return {(s.name, frozenset(s.labels.items())): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def test_metrics_endpoint_serves_config_info_and_process_metrics() -> None:
    config = ObservabilityConfig(metrics_port=_free_port(), trace_sample_ratio=0.5)
    server = serve_metrics("coordinator", config, "127.0.0.1", [])
    try:
        samples = _scrape(server.port)
    finally:
        server.stop()
    info = [dict(labels) for (name, labels) in samples if name == "corestream:config_info"]
    assert info == [{"service": "coordinator", "component": "ObservabilityConfig",
                     "metrics_port": str(config.metrics_port), "metrics_host": "",
                     "otlp_endpoint": "", "trace_sample_ratio": "0.5",
                     "trace_include_content": "False", "log_format": "text"}]
    assert any(name == "process_cpu_seconds_total" for name, _ in samples)


def test_config_info_hides_secrets() -> None:
    from dataclasses import dataclass

    @dataclass(frozen=True)
    class WithSecret:
        tls_key: str = "/etc/key.pem"
        api_key_file: str = "/etc/keys"
        hosts: tuple[str, ...] = ("a", "b")

    family = next(iter(ConfigInfo("frontend", [WithSecret()]).collect()))
    labels = family.samples[0].labels
    assert labels == {"service": "frontend", "component": "WithSecret", "hosts": "a,b"}


def test_metrics_port_zero_serves_nothing() -> None:
    server = serve_metrics("engine", ObservabilityConfig(), "127.0.0.1", [])
    assert server.port == 0


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


# ---- gRPC call metrics -----------------------------------------------------------


class _Health(health.HealthServicer):
    """Check answers; Check of service "bad" fails with NOT_FOUND (a real abort)."""

    def Check(self, request, context):  # noqa: N802
        if request.service == "bad":
            context.abort(grpc.StatusCode.NOT_FOUND, "unknown service bad")
        return health_pb2.HealthCheckResponse(status=health_pb2.HealthCheckResponse.SERVING)


def _handled(registry, method: str, code: str) -> float:
    value = registry.get_sample_value(
        "corestream:grpc_server_handled_total",
        {"grpc_service": "grpc.health.v1.Health", "grpc_method": method, "grpc_code": code})
    return value or 0.0


@pytest.mark.timeout(60)
def test_threaded_server_counts_calls_by_method_and_code() -> None:
    registry = new_registry(process_metrics=False)
    metrics = GrpcMetrics(registry)
    server = grpc.server(futures.ThreadPoolExecutor(4), interceptors=[metrics.interceptor()])
    servicer = _Health()
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            stub = health_pb2_grpc.HealthStub(channel)
            stub.Check(health_pb2.HealthCheckRequest(), timeout=5)
            stub.Check(health_pb2.HealthCheckRequest(), timeout=5)
            with pytest.raises(grpc.RpcError):
                stub.Check(health_pb2.HealthCheckRequest(service="bad"), timeout=5)
            # A server stream, cancelled by the client after its first message.
            watch = stub.Watch(health_pb2.HealthCheckRequest(), timeout=5)
            next(watch)
            watch.cancel()
        deadline = time.monotonic() + 10
        while not _handled(registry, "Watch", "CANCELLED") and time.monotonic() < deadline:
            time.sleep(0.05)
    finally:
        server.stop(0)
    assert _handled(registry, "Check", "OK") == 2
    assert _handled(registry, "Check", "NOT_FOUND") == 1
    assert _handled(registry, "Watch", "CANCELLED") == 1
    assert registry.get_sample_value(
        "corestream:grpc_server_started_total",
        {"grpc_service": "grpc.health.v1.Health", "grpc_method": "Check"}) == 3


class _AioHealth(health.aio.HealthServicer):
    async def Check(self, request, context):  # noqa: N802
        if request.service == "bad":
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "service: bad is not known")
        return health_pb2.HealthCheckResponse(status=health_pb2.HealthCheckResponse.SERVING)


@pytest.mark.timeout(60)
def test_asyncio_server_counts_calls_by_method_and_code() -> None:
    registry = new_registry(process_metrics=False)
    metrics = GrpcMetrics(registry)

    async def main() -> None:
        server = grpc.aio.server(interceptors=[metrics.aio_interceptor()])
        health_pb2_grpc.add_HealthServicer_to_server(_AioHealth(), server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
                stub = health_pb2_grpc.HealthStub(channel)
                await stub.Check(health_pb2.HealthCheckRequest(), timeout=5)
                with pytest.raises(grpc.aio.AioRpcError):
                    await stub.Check(health_pb2.HealthCheckRequest(service="bad"), timeout=5)
                # The client has the aborted call's status before the handler has
                # unwound (abort sends it, then raises): let it finish before the stop.
                for _ in range(500):
                    if _handled(registry, "Check", "INVALID_ARGUMENT"):
                        break
                    await asyncio.sleep(0.01)
        finally:
            await server.stop(0)

    asyncio.run(main())
    assert _handled(registry, "Check", "OK") == 1
    assert _handled(registry, "Check", "INVALID_ARGUMENT") == 1


# ---- tracing ---------------------------------------------------------------------


@pytest.fixture
def exporter() -> Iterator[InMemorySpanExporter]:
    yield InMemorySpanExporter()


def _flush(tracing: Tracing) -> None:
    assert tracing.provider is not None
    tracing.provider.force_flush()


def test_tracing_is_off_without_a_collector() -> None:
    tracing = Tracing("engine", ObservabilityConfig())
    assert not tracing.enabled
    assert tracing.server_interceptor() is None and tracing.aio_server_interceptor() is None
    span = tracing.tracer.start_span("x")
    assert not span.is_recording()
    tracing.shutdown()


def test_a_callers_traceparent_becomes_the_parent(exporter: InMemorySpanExporter) -> None:
    tracing = Tracing("engine", ObservabilityConfig(trace_sample_ratio=0.0), exporter=exporter)
    # Ratio 0 samples no new trace, but a sampled caller's decision wins (parent-based).
    tracing.tracer.start_span("root").end()
    tracing.tracer.start_span("child", context=extract({"traceparent": TRACEPARENT})).end()
    _flush(tracing)
    spans = exporter.get_finished_spans()
    assert [s.name for s in spans] == ["child"]
    assert format(spans[0].context.trace_id, "032x") == "4bf92f3577b34da6a3ce929d0e0e4736"
    assert format(spans[0].parent.span_id, "016x") == "00f067aa0ba902b7"
    assert spans[0].resource.attributes["service.name"] == "corestream-engine"


def test_inject_carries_the_span_to_another_process(exporter: InMemorySpanExporter) -> None:
    tracing = Tracing("frontend", ObservabilityConfig(), exporter=exporter)
    with tracing.tracer.start_as_current_span("request") as span:
        headers = inject()
    ctx = span.get_span_context()
    assert list(headers) == ["traceparent"]
    version, trace_id, span_id, flags = headers["traceparent"].split("-")
    assert (trace_id, span_id) == (f"{ctx.trace_id:032x}", f"{ctx.span_id:016x}")
    assert int(flags, 16) & 1  # sampled
    assert extract({}) is None


@pytest.mark.timeout(60)
def test_a_dead_collector_neither_slows_nor_blocks() -> None:
    # Nothing listens there: every export fails.
    tracing = Tracing("frontend", ObservabilityConfig(otlp_endpoint=f"127.0.0.1:{_free_port()}"))
    started = time.monotonic()
    for i in range(2000):
        with tracing.tracer.start_as_current_span(f"s{i}"):
            pass
    spent = time.monotonic() - started
    assert spent < 5.0  # ending a span only queues it (tens of microseconds each)
    started = time.monotonic()
    tracing.shutdown()
    assert time.monotonic() - started < SHUTDOWN_TIMEOUT_S + 2.0
