"""Observability across the real processes: one trace from client to engine, exact
metric deltas on each service's /metrics endpoint, JSON logs with request and trace ids.

One `corestream serve` (coordinator, one engine, frontend) exports spans to an OTLP
receiver that the test runs, and serves every process's metrics on one /metrics port,
each sample labelled with its process.
"""

from __future__ import annotations

import json
import threading
import time
import urllib.request
from collections.abc import Iterator

import grpc
import pytest
from corestream.generate.v1 import admin_service_pb2 as admin_pb2
from corestream.generate.v1 import admin_service_pb2_grpc as admin_grpc
from corestream.generate.v1 import generate_service_pb2 as pb
from corestream.generate.v1 import generate_service_pb2_grpc as pb_grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from prometheus_client.parser import text_string_to_metric_families

from tests.integration.cluster import Cluster, free_port
from tests.integration.otlp_collector import OtlpCollector, ReceivedSpan

pytestmark = pytest.mark.timeout(300)

CLIENT_TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
CLIENT_SPAN_ID = "00f067aa0ba902b7"
COORDINATOR, FRONTEND, ENGINE = "coordinator", "frontend", "engine-0"

Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]


@pytest.fixture(scope="module")
def collector() -> Iterator[OtlpCollector]:
    c = OtlpCollector().start()
    yield c
    c.stop()


@pytest.fixture(scope="module")
def cluster(collector: OtlpCollector) -> Iterator[tuple[Cluster, int]]:
    metrics_port = free_port()
    c = Cluster(["--metrics-port", str(metrics_port), "--otlp-endpoint", collector.endpoint,
                 "--log-format", "json"])
    yield c, metrics_port
    c.stop()


@pytest.fixture(scope="module")
def stub(cluster: tuple[Cluster, int]) -> Iterator[pb_grpc.GenerateServiceStub]:
    with grpc.insecure_channel(cluster[0].address) as channel:
        yield pb_grpc.GenerateServiceStub(channel)


def scrape(port: int, process: str) -> Samples:
    """One process's samples, from serve's endpoint for the cluster (its label dropped)."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as response:
        text = response.read().decode()
    return {
        (s.name, frozenset((k, v) for k, v in s.labels.items() if k != "process")): s.value
        for family in text_string_to_metric_families(text) for s in family.samples
        if s.labels.get("process") == process
    }


def value(samples: Samples, name: str, **labels: str) -> float:
    """The sum over the series of `name` whose labels include `labels` (0 if none)."""
    want = set(labels.items())
    return sum(v for (n, ls), v in samples.items() if n == name and want <= ls)


def stream(stub: pb_grpc.GenerateServiceStub, max_tokens: int,
           metadata: tuple[tuple[str, str], ...] = (), text: str = "the quick brown fox",
           ) -> tuple[int, dict[str, str]]:
    """Streams one request; the tokens received and the initial metadata."""
    request = pb.GenerateStreamRequest(
        text=text, sampling={"max_tokens": max_tokens, "ignore_eos": True, "temperature": 0.5})
    call = stub.GenerateStream(request, metadata=metadata, timeout=60)
    tokens = sum(len(chunk.token_ids) for chunk in call)
    return tokens, dict(call.initial_metadata())


def in_trace(trace_id: str, *names: str) -> object:
    return lambda spans: {n for n in names} <= {s.name for s in spans if s.trace_id == trace_id}


def one(spans: list[ReceivedSpan], name: str) -> ReceivedSpan:
    found = [s for s in spans if s.name == name]
    assert len(found) == 1, f"{len(found)} spans named {name!r}"
    return found[0]


def test_one_trace_from_client_to_engine(stub: pb_grpc.GenerateServiceStub,
                                         collector: OtlpCollector) -> None:
    traceparent = f"00-{CLIENT_TRACE_ID}-{CLIENT_SPAN_ID}-01"
    tokens, _ = stream(stub, 6, (("traceparent", traceparent),))
    assert tokens == 6
    names = ("text_completion tiny-llama-v2", "validate", "tokenize", "route", "detokenize",
             "engine.request", "engine.queue", "engine.prefill", "engine.decode")
    spans = [s for s in collector.wait_for(in_trace(CLIENT_TRACE_ID, *names))
             if s.trace_id == CLIENT_TRACE_ID]

    rpc = one(spans, "/corestream.generate.v1.GenerateService/GenerateStream")
    assert rpc.parent_span_id == CLIENT_SPAN_ID  # the client's traceparent is the parent
    assert rpc.service == "corestream-frontend"
    request = one(spans, "text_completion tiny-llama-v2")
    assert request.parent_span_id == rpc.span_id
    for phase in ("validate", "tokenize", "route", "detokenize"):
        assert one(spans, phase).parent_span_id == request.span_id
    attrs = request.attributes
    assert attrs["gen_ai.operation.name"] == "text_completion"
    assert attrs["gen_ai.request.model"] == "tiny-llama-v2"
    assert attrs["gen_ai.request.max_tokens"] == 6
    assert attrs["gen_ai.request.temperature"] == pytest.approx(0.5)
    assert attrs["gen_ai.usage.output_tokens"] == 6
    assert attrs["gen_ai.usage.input_tokens"] > 0
    assert attrs["gen_ai.response.finish_reasons"] == ["length"]
    assert attrs["gen_ai.latency.time_to_first_token"] > 0
    # Content is off by default.
    assert "gen_ai.prompt" not in attrs and "gen_ai.completion" not in attrs

    engine = one(spans, "engine.request")
    assert engine.service == "corestream-engine"
    assert engine.parent_span_id == request.span_id  # carried inside the Session's add
    assert engine.attributes["gen_ai.usage.output_tokens"] == 6
    assert engine.attributes["gen_ai.usage.input_tokens"] == attrs["gen_ai.usage.input_tokens"]
    assert engine.attributes["gen_ai.latency.time_in_queue"] >= 0
    assert engine.attributes["gen_ai.latency.time_to_first_token"] > 0
    assert engine.attributes["corestream.engine.index"] == 0
    assert engine.events == ("queued", "scheduled", "first_token")
    for child in ("engine.queue", "engine.prefill", "engine.decode"):
        span = one(spans, child)
        assert span.parent_span_id == engine.span_id
        assert engine.start_ns <= span.start_ns <= span.end_ns <= engine.end_ns
    # The decode is one summary span, never one per token.
    assert one(spans, "engine.decode").attributes["corestream.decode.steps"] == 5


def test_unary_generate_starts_a_trace_that_reaches_the_engine(
        stub: pb_grpc.GenerateServiceStub, collector: OtlpCollector) -> None:
    response = stub.Generate(pb.GenerateRequest(
        request_id="obs-unary", text="hello",
        sampling={"max_tokens": 3, "ignore_eos": True}), timeout=60)
    assert len(response.completions[0].token_ids) == 3

    def found(spans: list[ReceivedSpan]) -> bool:
        ids = {s.trace_id for s in spans if s.name.endswith("/Generate")}
        return any(s.name == "engine.request" and s.trace_id in ids for s in spans)

    spans = collector.wait_for(found)
    rpc = next(s for s in spans if s.name.endswith("/Generate"))
    assert rpc.parent_span_id == ""  # no traceparent from the client: a new trace
    engine = [s for s in spans if s.trace_id == rpc.trace_id and s.name == "engine.request"]
    assert len(engine) == 1


def test_health_checks_are_not_traced(cluster: tuple[Cluster, int],
                                      collector: OtlpCollector) -> None:
    with grpc.insecure_channel(cluster[0].address) as channel:
        health = health_pb2_grpc.HealthStub(channel)
        for _ in range(3):
            health.Check(health_pb2.HealthCheckRequest(service=""), timeout=5)
        # A traced call after them: once its span is in, theirs would be too.
        pb_grpc.GenerateServiceStub(channel).GetModelInfo(pb.GetModelInfoRequest(), timeout=5)
    spans = collector.wait_for(lambda spans: sum(s.name.endswith("/GetModelInfo")
                                                 for s in spans) >= 2)
    assert not [s.name for s in spans if "grpc.health" in s.name]


def test_metrics_move_by_exactly_the_workload(cluster: tuple[Cluster, int],
                                              stub: pb_grpc.GenerateServiceStub) -> None:
    c, port = cluster
    max_tokens = [4, 7, 9]
    before = {p: scrape(port, p) for p in (FRONTEND, ENGINE)}
    prompt_ids = stub.Tokenize(pb.TokenizeRequest(text="the quick brown fox"), timeout=10)
    with grpc.insecure_channel(c.address) as channel:
        admin = admin_grpc.AdminServiceStub(channel)
        admin.PauseScheduling(admin_pb2.PauseSchedulingRequest(mode=admin_pb2.PAUSE_MODE_KEEP),
                              timeout=10)
        streamed: list[int] = []
        threads = [threading.Thread(target=lambda n=n: streamed.append(stream(stub, n)[0]))
                   for n in max_tokens]
        for t in threads:
            t.start()
        # During: the paused engine holds every request in its waiting queue.
        deadline = time.monotonic() + 30
        while value(during := scrape(port, ENGINE), "corestream:num_requests_waiting") < 3:
            assert time.monotonic() < deadline, "the requests never showed as waiting"
            time.sleep(0.05)
        assert value(during, "corestream:num_requests_running") == 0
        assert value(during, "corestream:engine_state", state="RUNNING") == 1
        assert value(during, "corestream:engine_state", state="DEAD") == 0
        admin.ResumeScheduling(admin_pb2.ResumeSchedulingRequest(), timeout=10)
        for t in threads:
            t.join(60)
    assert sorted(streamed) == max_tokens

    after = {p: scrape(port, p) for p in (FRONTEND, ENGINE)}

    def delta(p: str, name: str, **labels: str) -> float:
        return value(after[p], name, **labels) - value(before[p], name, **labels)

    n = len(max_tokens)
    assert delta(ENGINE, "corestream:generation_tokens_total") == sum(streamed)
    assert delta(ENGINE, "corestream:prompt_tokens_total") == n * len(prompt_ids.token_ids)
    assert delta(ENGINE, "corestream:request_queue_time_seconds_count") == n
    # The queue wait covered the pause: the engine saw them wait at least that long.
    assert delta(ENGINE, "corestream:request_queue_time_seconds_sum") > 0
    assert delta(ENGINE, "corestream:prefix_cache_queries_total") >= len(prompt_ids.token_ids)
    # The gauges come from the stats the loop publishes after the step that ended them.
    deadline = time.monotonic() + 10
    while (value(idle := scrape(port, ENGINE), "corestream:num_requests_running"),
           value(idle, "corestream:num_requests_waiting")) != (0, 0):
        assert time.monotonic() < deadline, "the engine never showed idle"
        time.sleep(0.05)
    assert value(after[ENGINE], "corestream:last_step_timestamp_seconds") > time.time() - 120

    assert delta(FRONTEND, "corestream:request_success_total", finished_reason="length",
                 engine="0", model_name="tiny-llama-v2") == n
    assert delta(FRONTEND, "corestream:time_to_first_token_seconds_count") == n
    assert delta(FRONTEND, "corestream:e2e_request_latency_seconds_count") == n
    # One inter-token interval per token after the first (one token per step here).
    assert delta(FRONTEND, "corestream:inter_token_latency_seconds_count") == sum(streamed) - n
    assert delta(FRONTEND, "corestream:grpc_server_handled_total", grpc_method="GenerateStream",
                 grpc_code="OK") == n


def test_rejections_count_by_reason_and_code(cluster: tuple[Cluster, int],
                                             stub: pb_grpc.GenerateServiceStub) -> None:
    port = cluster[1]
    rejected = {"code": "INVALID_ARGUMENT"}
    handled = {"grpc_method": "GenerateStream", "grpc_code": "INVALID_ARGUMENT"}

    def counts() -> tuple[float, float]:
        samples = scrape(port, FRONTEND)
        return (value(samples, "corestream:requests_rejected_total", **rejected),
                value(samples, "corestream:grpc_server_handled_total", **handled))

    before = counts()
    with pytest.raises(grpc.RpcError) as error:
        stream(stub, 0)
    assert error.value.code() is grpc.StatusCode.INVALID_ARGUMENT
    # The status reaches the client as the handler aborts, a moment before the
    # interceptor counts the call: wait for it, then check nothing more moved.
    deadline = time.monotonic() + 10
    while (after := counts()) != (before[0] + 1, before[1] + 1):
        assert time.monotonic() < deadline, (before, after)
        time.sleep(0.05)
    time.sleep(0.2)
    assert counts() == after


def test_json_logs_carry_the_clients_request_id_and_trace_id(
        cluster: tuple[Cluster, int], stub: pb_grpc.GenerateServiceStub) -> None:
    trace_id = "0123456789abcdef0123456789abcdef"
    _, metadata = stream(stub, 2, (("x-request-id", "obs-log-1"),
                                   ("traceparent", f"00-{trace_id}-{CLIENT_SPAN_ID}-01")))
    assert metadata["x-request-id"] == "obs-log-1"  # used as the request id and echoed
    deadline = time.monotonic() + 10
    while True:
        entries = [json.loads(line[line.index("{"):]) for line in cluster[0].lines
                   if '"obs-log-1"' in line]
        if entries or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    assert entries, cluster[0].output()
    entry = entries[0]
    assert entry["request_id"] == "obs-log-1"
    assert entry["trace_id"] == trace_id
    assert entry["service"] == "frontend" and entry["level"] == "INFO"
    assert "request finished" in entry["message"]


def test_each_endpoint_shows_its_effective_configuration(cluster: tuple[Cluster, int]) -> None:
    port = cluster[1]
    expected = {COORDINATOR: "CoordinatorConfig", FRONTEND: "FrontendConfig",
                ENGINE: "EngineConfig"}
    for process, component in expected.items():
        samples = scrape(port, process)
        info = [dict(labels) for (name, labels), _ in samples.items()
                if name == "corestream:config_info" and ("component", component) in labels]
        assert len(info) == 1, component
        observability = [dict(labels) for (name, labels), _ in samples.items()
                         if name == "corestream:config_info"
                         and ("component", "ObservabilityConfig") in labels]
        # Each process's own endpoint is private; serve's port serves them all.
        assert observability[0]["metrics_host"] == "127.0.0.1"
        assert int(observability[0]["metrics_port"]) not in (0, port)
        assert observability[0]["log_format"] == "json"


def test_coordinator_counts_its_calls(cluster: tuple[Cluster, int]) -> None:
    samples = scrape(cluster[1], COORDINATOR)
    coordinator = "corestream.coordinator.v1.CoordinatorService"
    assert value(samples, "corestream:grpc_server_handled_total", grpc_service=coordinator,
                 grpc_method="RegisterEngine", grpc_code="OK") == 1  # one engine
    # The engine's load stream and the frontend's watch are open for the cluster's life.
    for method in ("ReportLoad", "WatchLoad"):
        assert value(samples, "corestream:grpc_server_started_total", grpc_service=coordinator,
                     grpc_method=method) >= 1
    assert value(samples, "corestream:coordinator_engines", state="RUNNING",
                 model_name="tiny-llama-v2") == 1
    assert value(samples, "corestream:coordinator_engines", state="DEAD") == 0


def test_a_dead_collector_does_not_break_serving() -> None:
    # Nothing listens on that port: every export fails, in the background.
    cluster = Cluster(["--otlp-endpoint", f"127.0.0.1:{free_port()}"])
    try:
        with grpc.insecure_channel(cluster.address) as channel:
            stub = pb_grpc.GenerateServiceStub(channel)
            started = time.monotonic()
            for _ in range(3):
                assert stream(stub, 8)[0] == 8
            assert time.monotonic() - started < 30  # export timeouts are 3 s: never waited on
    finally:
        stopped = time.monotonic()
        assert cluster.stop() == 0
    # Shutdown waits for the exporter at most a few seconds per process.
    assert time.monotonic() - stopped < 45
