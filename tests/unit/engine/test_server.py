"""EngineCoreService in-process on 127.0.0.1:0 with the real tiny runner."""

from __future__ import annotations

import json
import threading

import grpc
import pytest
from corestream.common.v1 import common_pb2
from corestream.engine.v1 import engine_core_service_pb2 as pb
from corestream.engine.v1 import engine_core_service_pb2_grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from prometheus_client import generate_latest

from services.common.metrics import new_registry
from services.engine.config import EngineConfig
from services.engine.core.engine_core import EngineCore
from services.engine.metrics import EngineMetrics
from services.engine.server import SERVICE_NAME, EngineServer
from services.engine.worker.config import RunnerConfig
from services.engine.worker.model_runner import ModelRunner
from tests.unit.engine.fakes import SessionClient


@pytest.fixture(scope="module")
def runner() -> ModelRunner:
    r = ModelRunner(RunnerConfig(kv_cache_memory=8 << 20))
    r.warmup()
    return r


def tokens(outputs: list[pb.RequestOutput]) -> list[int]:
    return [t for o in outputs for t in o.new_token_ids]


@pytest.mark.timeout(60)
def test_two_requests_stream_batched_outputs(channel: grpc.Channel) -> None:
    client = SessionClient(channel)
    # Paused ("keep") while both arrive, so that they start in the same step however
    # late the second add reaches the loop (on a loaded machine "a" could finish first).
    client.send(pb.SessionRequest(utility=pb.UtilityCall(
        call_id=1, method="pause", args_json='{"mode": "keep"}')))
    client.add("a", [1, 5, 9, 12], max_tokens=8)
    client.add("b", [1, 7, 3], max_tokens=8)
    client.send(pb.SessionRequest(utility=pb.UtilityCall(call_id=2, method="resume")))
    outputs, messages = client.collect({"a", "b"})
    messages = [m for m in messages if not m.HasField("utility_result")]
    client.close()
    for rid in "ab":
        assert outputs[rid][-1].finish_reason in (
            common_pb2.FINISH_REASON_LENGTH, common_pb2.FINISH_REASON_EOS_TOKEN)
        assert 1 <= len(tokens(outputs[rid])) <= 8
    assert any(len(m.outputs) == 2 for m in messages)  # batched per step
    assert all(m.engine_state == common_pb2.ENGINE_STATE_RUNNING for m in messages)
    assert messages[-1].scheduler_stats.step_counter > 0

    # Greedy decoding is deterministic: the same prompt on a new session gives the same tokens.
    again = SessionClient(channel)
    again.add("a2", [1, 5, 9, 12], max_tokens=8)
    outputs2, _ = again.collect({"a2"})
    again.close()
    assert tokens(outputs2["a2"]) == tokens(outputs["a"])


@pytest.mark.timeout(60)
def test_abort_ends_request(channel: grpc.Channel, server: EngineServer) -> None:
    client = SessionClient(channel)
    client.add("long", [1, 2, 3], max_tokens=1000)
    first = next(client.responses)
    assert first.outputs[0].request_id == "long"
    client.send(pb.SessionRequest(abort=pb.AbortRequests(request_ids=["long"])))
    outputs, _ = client.collect({"long"})
    client.close()
    assert outputs["long"][-1].finish_reason == common_pb2.FINISH_REASON_ABORT
    assert len(tokens(outputs["long"])) < 1000
    assert not server.core.scheduler.has_work()


@pytest.mark.timeout(60)
def test_rejected_request_reports_error(channel: grpc.Channel) -> None:
    client = SessionClient(channel)
    client.add("huge", list(range(1, 3000)), max_tokens=4)
    outputs, _ = client.collect({"huge"})
    client.close()
    [out] = outputs["huge"]
    assert out.finish_reason == common_pb2.FINISH_REASON_ERROR
    assert out.error_code == grpc.StatusCode.INVALID_ARGUMENT.value[0]
    assert "max_model_len" in out.error_message


@pytest.mark.timeout(60)
def test_broken_session_aborts_its_requests(channel: grpc.Channel,
                                            server: EngineServer) -> None:
    client = SessionClient(channel)
    client.add("orphan", [1, 2, 3], max_tokens=1000)
    next(client.responses)
    client.responses.cancel()
    client.close()
    done = threading.Event()
    for _ in range(200):
        if not server.core.scheduler.has_work():
            done.set()
            break
        done.wait(0.05)
    assert done.is_set()
    done.wait(0.1)  # the loop publishes stats after the iteration that applied the abort
    assert server.core.stats.kv_cache_usage == 0 and server.core.stats.num_running == 0


@pytest.mark.timeout(60)
def test_engine_info_and_health(channel: grpc.Channel, runner: ModelRunner) -> None:
    stub = engine_core_service_pb2_grpc.EngineCoreServiceStub(channel)
    info = stub.GetEngineInfo(pb.GetEngineInfoRequest())
    assert info.model == runner.model_info.name
    assert info.vocab_size == runner.model_info.vocab_size
    assert info.num_kv_blocks == runner.num_blocks and info.block_size == runner.block_size
    assert 0 < info.max_model_len <= runner.model_info.max_model_len
    assert info.device == "cpu" and info.dtype == "float32"
    assert info.state == common_pb2.ENGINE_STATE_RUNNING
    assert info.tensor_parallel_size == 1
    health = health_pb2_grpc.HealthStub(channel)
    reply = health.Check(health_pb2.HealthCheckRequest(service=SERVICE_NAME))
    assert reply.status == health_pb2.HealthCheckResponse.SERVING


def test_metrics_of_a_core_read_its_runner_ranks(runner: ModelRunner) -> None:
    core = EngineCore(EngineConfig(), runner)
    registry = new_registry(process_metrics=False)
    core.observer = EngineMetrics(registry, "tiny", 0, lambda: core.stats, lambda: core.state,
                                  executor=runner)
    labels = {"model_name": "tiny", "engine": "0"}
    assert registry.get_sample_value("corestream:tensor_parallel_size", labels) == 1
    # One rank: no per-rank call counts.
    assert "corestream:tensor_parallel_calls_total{" not in generate_latest(registry).decode()


@pytest.mark.timeout(90)
def test_engine_process_serves_and_exits_zero_on_sigterm() -> None:
    import signal
    import subprocess
    import sys

    proc = subprocess.Popen(
        [sys.executable, "-m", "services.engine.main", "--port", "0",
         "--kv-cache-memory", str(8 << 20)],
        stderr=subprocess.PIPE, text=True,
    )
    try:
        assert proc.stderr is not None
        address = ""
        for line in proc.stderr:
            if "listening on" in line:
                address = line.rsplit(" ", 1)[-1].strip()
                break
        assert address.startswith("127.0.0.1:")
        with grpc.insecure_channel(address) as ch:
            stub = engine_core_service_pb2_grpc.EngineCoreServiceStub(ch)
            info = stub.GetEngineInfo(pb.GetEngineInfoRequest(), timeout=10)
            assert info.model
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


@pytest.mark.timeout(60)
def test_utility_calls_answer_with_their_call_id(channel: grpc.Channel) -> None:
    client = SessionClient(channel)

    def call(call_id: int, method: str, args_json: str = "") -> pb.UtilityResult:
        client.send(pb.SessionRequest(utility=pb.UtilityCall(
            call_id=call_id, method=method, args_json=args_json)))
        for msg in client.responses:
            if msg.HasField("utility_result"):
                return msg.utility_result
        raise AssertionError("the session ended without a reply")

    stats = call(7, "get_stats")
    assert stats.call_id == 7 and not stats.failure_message
    assert json.loads(stats.result_json)["state"] == "RUNNING"
    paused = call(8, "pause", '{"mode": "keep"}')
    assert json.loads(paused.result_json)["mode"] == "keep"
    assert json.loads(call(9, "resume").result_json)["was_paused"] == "keep"
    unknown = call(10, "no_such_thing")
    assert unknown.call_id == 10 and "no_such_thing" in unknown.failure_message
    bad = call(11, "pause", "[1, 2")
    assert bad.call_id == 11 and "bad args_json" in bad.failure_message
    # The engine still serves after the failures.
    client.add("after", [1, 2, 3], max_tokens=2)
    outputs, _ = client.collect({"after"})
    client.close()
    assert len(tokens(outputs["after"])) >= 1


@pytest.mark.timeout(60)
def test_sessions_of_two_frontends_may_reuse_request_ids(channel: grpc.Channel,
                                                         server: EngineServer) -> None:
    first, second = SessionClient(channel), SessionClient(channel)
    first.add("r", [1, 5, 9, 12], max_tokens=1000)
    second.add("r", [1, 7, 3], max_tokens=6)
    # Both run side by side; aborting the first's "r" leaves the second's alone.
    assert next(first.responses).outputs[0].request_id == "r"
    first.send(pb.SessionRequest(abort=pb.AbortRequests(request_ids=["r"])))
    outputs, _ = first.collect({"r"})
    assert outputs["r"][-1].finish_reason == common_pb2.FINISH_REASON_ABORT
    outputs2, _ = second.collect({"r"})
    assert outputs2["r"][-1].finish_reason in (
        common_pb2.FINISH_REASON_LENGTH, common_pb2.FINISH_REASON_EOS_TOKEN)
    assert 1 <= len(tokens(outputs2["r"])) <= 6
    # Alone, the second prompt gives the same tokens: nothing of the first leaked in.
    alone = SessionClient(channel)
    alone.add("r", [1, 7, 3], max_tokens=6)
    outputs3, _ = alone.collect({"r"})
    assert tokens(outputs3["r"]) == tokens(outputs2["r"])
    for client in (first, second, alone):
        client.close()
