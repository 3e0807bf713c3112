"""Data-parallel routing with real processes on 127.0.0.1: a coordinator, dense
engines and frontends started one by one, so that each can be killed, frozen,
restarted or added while the others serve.

Requests per engine are read from each engine's statistics (AdminService
GetEngineStats): every request adds its prompt length to `prefix_cache_queries`
when the engine admits it, and all prompts here have PROMPT_LEN tokens.

The tests share one cluster and run in file order, each leaving it serving.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from concurrent import futures

import grpc
import pytest
from corestream.common.v1 import common_pb2
from corestream.coordinator.v1 import coordinator_service_pb2 as coord_pb
from corestream.coordinator.v1 import coordinator_service_pb2_grpc as coord_grpc
from corestream.generate.v1 import admin_service_pb2 as admin_pb
from corestream.generate.v1 import admin_service_pb2_grpc as admin_grpc
from corestream.generate.v1 import generate_service_pb2 as pb
from corestream.generate.v1 import generate_service_pb2_grpc as pb_grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from services.common.tiny_checkpoint import resolve_model
from tests.integration.cluster import REPO, free_port

pytestmark = pytest.mark.timeout(240)

PROMPT_LEN = 5
RUNNING = common_pb2.ENGINE_STATE_RUNNING
SERVING = health_pb2.HealthCheckResponse.SERVING
GENERATE_SERVICE = "corestream.generate.v1.GenerateService"


class Service:
    """One `corestream <service>` process; its output is kept for failure messages."""

    def __init__(self, *argv: str) -> None:
        self.argv = argv
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "services.cli", *argv], cwd=REPO, text=True,
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
        )
        self.lines: list[str] = []
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.append(line)

    def wait_for_log(self, pattern: str, timeout_s: float = 120) -> re.Match[str]:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            for line in list(self.lines):
                if m := re.search(pattern, line):
                    return m
            if self.proc.poll() is not None:
                break
            time.sleep(0.1)
        raise AssertionError(f"{self.argv[0]} never logged {pattern!r}:\n{self.output()}")

    def output(self) -> str:
        return "".join(self.lines[-80:])

    def stop(self, sig: int = signal.SIGTERM, timeout_s: float = 30) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


class DpCluster:
    def __init__(self) -> None:
        self.model = str(resolve_model(None))  # written once, not by racing engines
        self.coordinator_address = f"127.0.0.1:{free_port()}"
        self.coordinator = self.start_coordinator()
        self.engines: dict[int, Service] = {}
        self.frontends: list[Service] = []

    def start_coordinator(self) -> Service:
        port = self.coordinator_address.rsplit(":", 1)[1]
        service = Service("coordinator", "--port", port, "--report-interval-s", "0.5",
                          "--lease-timeout-s", "2", "--watch-heartbeat-s", "1")
        service.wait_for_log(r"coordinator listening on")
        return service

    def start_engine(self, index: int) -> Service:
        service = Service("engine", "--model", self.model, "--port", "0",
                          "--engine-index", str(index), "--coordinator",
                          self.coordinator_address, "--shutdown-timeout", "2")
        self.engines[index] = service
        return service

    def start_frontend(self) -> str:
        port = free_port()
        service = Service("frontend", "--model", self.model, "--port", str(port),
                          "--coordinator", self.coordinator_address)
        self.frontends.append(service)
        service.wait_for_log(r"frontend listening on")
        return f"127.0.0.1:{port}"

    def output(self) -> str:
        parts = [("coordinator", self.coordinator)]
        parts += [(f"engine {i}", s) for i, s in self.engines.items()]
        parts += [(f"frontend {i}", s) for i, s in enumerate(self.frontends)]
        return "\n".join(f"--- {name}\n{s.output()}" for name, s in parts)

    def stop(self) -> None:
        for service in [*self.frontends, *self.engines.values(), self.coordinator]:
            service.stop()


@pytest.fixture(scope="module")
def dp() -> Iterator[DpCluster]:
    cluster = DpCluster()
    try:
        for index in (0, 1):
            cluster.start_engine(index)
        cluster.frontend = cluster.start_frontend()  # type: ignore[attr-defined]
        yield cluster
    finally:
        cluster.stop()


@pytest.fixture(scope="module")
def channel(dp: DpCluster) -> Iterator[grpc.Channel]:
    with grpc.insecure_channel(dp.frontend) as ch:  # type: ignore[attr-defined]
        yield ch


def wait_until(check: Callable[[], bool], what: str, dp: DpCluster, timeout_s: float = 120) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            if check():
                return
        except grpc.RpcError:
            pass
        time.sleep(0.1)
    raise AssertionError(f"timed out waiting for {what}\n{dp.output()}")


def model_info(channel: grpc.Channel) -> pb.GetModelInfoResponse:
    return pb_grpc.GenerateServiceStub(channel).GetModelInfo(pb.GetModelInfoRequest(), timeout=5)


def list_engines(dp: DpCluster) -> list[coord_pb.EngineLoad]:
    with grpc.insecure_channel(dp.coordinator_address) as ch:
        stub = coord_grpc.CoordinatorServiceStub(ch)
        return list(stub.ListEngines(coord_pb.ListEnginesRequest(), timeout=5).engines)


def admitted(channel: grpc.Channel) -> dict[int, int]:
    """Requests each engine (by rank) has admitted so far."""
    reply = admin_grpc.AdminServiceStub(channel).GetEngineStats(
        admin_pb.GetEngineStatsRequest(), timeout=10)
    counts = {}
    for result in reply.results:
        assert result.ok, result.message
        queries = json.loads(result.result_json)["prefix_cache_queries"]
        assert queries % PROMPT_LEN == 0, "every prompt here has PROMPT_LEN tokens"
        counts[result.engine_index] = queries // PROMPT_LEN
    return counts


def delta(before: dict[int, int], after: dict[int, int]) -> dict[int, int]:
    return {rank: n - before.get(rank, 0) for rank, n in after.items()}


def request(max_tokens: int, rank: int | None = None, seed: int = 0,
            request_id: str = "") -> pb.GenerateRequest:
    sampling = common_pb2.SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    prompt = pb.TokenIds(ids=[3 + seed % 50, 7, 11, 13, 17])
    assert len(prompt.ids) == PROMPT_LEN
    return pb.GenerateRequest(token_ids=prompt, sampling=sampling, data_parallel_rank=rank,
                              request_id=request_id)


def burst(channel: grpc.Channel, count: int, max_tokens: int = 4) -> None:
    stub = pb_grpc.GenerateServiceStub(channel)
    with futures.ThreadPoolExecutor(count) as pool:
        calls = [pool.submit(stub.Generate, request(max_tokens, seed=i), timeout=60)
                 for i in range(count)]
        for call in calls:
            assert call.result().completions[0].finish_reason == common_pb2.FINISH_REASON_LENGTH


def test_cluster_serves_on_two_engines(dp: DpCluster, channel: grpc.Channel) -> None:
    wait_until(lambda: model_info(channel).num_engines == 2, "two engines", dp)
    # Engines register in their state: routable as soon as the frontend hears of them.
    assert [e.state for e in list_engines(dp)] == [RUNNING, RUNNING]
    assert not model_info(channel).degraded
    assert {e.max_num_seqs for e in list_engines(dp)} == {128}  # capacity registered


def test_pinned_rank_and_bad_ranks(dp: DpCluster, channel: grpc.Channel) -> None:
    stub = pb_grpc.GenerateServiceStub(channel)
    before = admitted(channel)
    for _ in range(3):
        stub.Generate(request(2, rank=1), timeout=60)
    assert delta(before, admitted(channel)) == {0: 0, 1: 3}
    with pytest.raises(grpc.RpcError) as err:
        stub.Generate(request(2, rank=5), timeout=60)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "data_parallel_rank 5" in err.value.details()


def test_busier_engine_gets_fewer_new_requests(dp: DpCluster, channel: grpc.Channel) -> None:
    stub = pb_grpc.GenerateServiceStub(channel)
    long_calls = [stub.GenerateStream(
        pb.GenerateStreamRequest(token_ids=request(1).token_ids, data_parallel_rank=0,
                                 sampling=common_pb2.SamplingParams(
                                     temperature=0.0, max_tokens=2000, ignore_eos=True)),
        timeout=120) for _ in range(6)]
    try:
        for call in long_calls:
            next(call)  # each is running on engine 0
        busy = lambda: [(e.engine_index, e.num_running) for e in list_engines(dp)]  # noqa: E731
        wait_until(lambda: (0, 6) in busy(), "engine 0 reporting six running requests", dp)
        time.sleep(0.5)  # a snapshot or two reach the frontend
        before = admitted(channel)
        burst(channel, 12)
        got = delta(before, admitted(channel))
    finally:
        for call in long_calls:
            call.cancel()
    print(f"\nnew requests per engine with engine 0 running 6 long ones: {got}")
    assert sum(got.values()) == 12
    # Balanced load would send 3 to engine 0 and 9 to engine 1.
    assert got[1] >= got[0] + 4, got


def test_coordinator_loss_and_return(dp: DpCluster, channel: grpc.Channel) -> None:
    dp.coordinator.stop(signal.SIGKILL)
    wait_until(lambda: model_info(channel).degraded, "the frontend to turn degraded", dp)
    assert model_info(channel).num_engines == 2
    before = admitted(channel)
    burst(channel, 8)  # served on the frontend's own counts
    got = delta(before, admitted(channel))
    assert sum(got.values()) == 8 and min(got.values()) >= 2, got
    assert any("degraded" in line for line in dp.frontends[0].lines)

    dp.coordinator = dp.start_coordinator()  # same port
    wait_until(lambda: sum(e.state == RUNNING for e in list_engines(dp)) == 2,
               "both engines registered again", dp)
    wait_until(lambda: not model_info(channel).degraded, "the frontend to recover", dp)
    with grpc.insecure_channel(dp.coordinator_address) as ch:
        watch = coord_grpc.CoordinatorServiceStub(ch).WatchLoad(coord_pb.WatchLoadRequest(),
                                                               timeout=30)
        assert len(next(watch).engines) == 2  # snapshots flow again
        watch.cancel()
    burst(channel, 4)


def test_second_frontend_shares_engines_with_the_same_request_ids(
    dp: DpCluster, channel: grpc.Channel
) -> None:
    with grpc.insecure_channel(dp.start_frontend()) as other:
        wait_until(lambda: model_info(other).num_engines == 2, "frontend 2 sees engines", dp)
        stubs = [pb_grpc.GenerateServiceStub(ch) for ch in (channel, other)]
        # The same id from both frontends, on the same engine, at the same time.
        with futures.ThreadPoolExecutor(2) as pool:
            calls = [pool.submit(s.Generate, request(40, rank=0, seed=i, request_id="same"),
                                 timeout=60) for i, s in enumerate(stubs)]
            replies = [c.result() for c in calls]
    assert [len(r.completions[0].token_ids) for r in replies] == [40, 40]
    dp.frontends.pop().stop()


def test_engine_added_at_run_time_gets_traffic(dp: DpCluster, channel: grpc.Channel) -> None:
    dp.start_engine(2)
    wait_until(lambda: model_info(channel).num_engines == 3, "the third engine", dp)
    before = admitted(channel)
    burst(channel, 9)
    got = delta(before, admitted(channel))
    assert sum(got.values()) == 9 and got[2] >= 2, got


def test_frozen_engine_is_dropped_after_its_lease_and_rejoins(
    dp: DpCluster, channel: grpc.Channel
) -> None:
    frozen = dp.engines[2].proc.pid
    os.kill(frozen, signal.SIGSTOP)
    try:
        wait_until(lambda: {e.engine_index for e in list_engines(dp)} == {0, 1},
                   "the frozen engine to leave the snapshots", dp, timeout_s=30)
        # The frontend learns it from the next snapshot it watches, a moment later.
        wait_until(lambda: model_info(channel).num_engines == 2,
                   "the frontend to stop routing to the frozen engine", dp, timeout_s=30)
        burst(channel, 4)  # routed around it
    finally:
        os.kill(frozen, signal.SIGCONT)
    wait_until(lambda: {e.engine_index for e in list_engines(dp)} == {0, 1, 2},
               "the engine to register again", dp, timeout_s=30)


def test_health_not_serving_without_engines_and_back(
    dp: DpCluster, channel: grpc.Channel
) -> None:
    health = health_pb2_grpc.HealthStub(channel)
    status = lambda: health.Check(  # noqa: E731
        health_pb2.HealthCheckRequest(service=GENERATE_SERVICE), timeout=5).status
    assert status() == SERVING
    with futures.ThreadPoolExecutor(3) as pool:
        list(pool.map(lambda s: s.stop(), list(dp.engines.values())))
    wait_until(lambda: status() != SERVING, "NOT_SERVING with no engine left", dp)
    dp.start_engine(0)
    wait_until(lambda: status() == SERVING, "SERVING again with an engine back", dp)
    burst(channel, 2)
