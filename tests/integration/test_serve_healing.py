"""`corestream serve` heals itself: SIGKILL each kind of process under a real cluster
and it comes back (the coordinator and frontend on their ports, an engine on its
rank) while requests keep being served; a crash-looping engine is given up; SIGTERM
during a restart still stops everything.

The first tests share one two-engine cluster and run in file order, each leaving it
serving; the last one stops it. Every test prints what it measured (-s shows it).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
from corestream.common.v1 import common_pb2
from corestream.generate.v1 import generate_service_pb2 as pb
from corestream.generate.v1 import generate_service_pb2_grpc as pb_grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from services.engine.executor.fault_injection import ENV_VAR as FAULT_INJECT
from tests.integration.cluster import REPO, Cluster, alive, descendants, free_port
from tests.integration.faults import start_stream, wait_all, wait_for

pytestmark = pytest.mark.timeout(240)

DEATH_TO_UNAVAILABLE_S = 5.0
# Measured on 2 shared CPU cores (see README, "Self-healing under serve"): the killed
# engine took 4.7-12 s to take requests again, most of it importing torch and loading.
ENGINE_BACK_S = 60.0
SERVING = health_pb2.HealthCheckResponse.SERVING


def child_pid(c: Cluster, role: str) -> int:
    """The pid of serve's live `role` child (coordinator, frontend)."""
    for pid in descendants(c.proc.pid):
        try:
            argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if len(argv) > 3 and argv[3] == role.encode() and alive(pid):
            return pid
    raise LookupError(f"no {role} below serve:\n{c.output()}")


def log(c: Cluster) -> str:
    """Everything serve and its children logged (output() keeps only the tail)."""
    return "".join(c.lines)


def generate(stub: pb_grpc.GenerateServiceStub, text: str, rank: int | None = None,
             timeout: float = 60) -> pb.GenerateResponse:
    request = pb.GenerateRequest(text=text, sampling=common_pb2.SamplingParams(
        temperature=0.0, max_tokens=4, ignore_eos=True))
    if rank is not None:
        request.data_parallel_rank = rank
    return stub.Generate(request, timeout=timeout)


def succeeds(call: Callable[[], Any]) -> Callable[[], bool]:
    def check() -> bool:
        try:
            call()
            return True
        except grpc.RpcError:
            return False
    return check


class Traffic:
    """New unary requests one after another on a thread, each failure kept with the time
    its request was sent."""

    def __init__(self, stub: pb_grpc.GenerateServiceStub) -> None:
        self.ok = 0
        self.failures: list[tuple[float, str]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(stub,), daemon=True)
        self._thread.start()

    def _run(self, stub: pb_grpc.GenerateServiceStub) -> None:
        while not self._stop.is_set():
            sent_at = time.monotonic()
            try:
                generate(stub, f"new {self.ok}")
                self.ok += 1
            except grpc.RpcError as e:
                self.failures.append((sent_at, f"{e.code().name}: {e.details()}"))

    def failed_after(self, moment: float) -> list[str]:
        return [message for sent_at, message in self.failures if sent_at >= moment]

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(90)


def admin_stats(address: str) -> list[dict[str, Any]]:
    done = subprocess.run([sys.executable, "-m", "services.cli", "admin", "--address", address,
                           "stats", "--timeout", "20"], cwd=REPO, capture_output=True,
                          text=True, timeout=60)
    results: list[dict[str, Any]] = json.loads(done.stdout)
    return results


@pytest.fixture(scope="module")
def metrics_port() -> int:
    return free_port()  # serve's one endpoint for the cluster


@pytest.fixture(scope="module")
def cluster(metrics_port: int) -> Iterator[Cluster]:
    c = Cluster(["--engines", "2", "--shutdown-timeout", "5", "--metrics-port",
                 str(metrics_port)])
    yield c
    c.stop(timeout=60)


@pytest.fixture(scope="module")
def stub(cluster: Cluster) -> Iterator[pb_grpc.GenerateServiceStub]:
    with grpc.insecure_channel(cluster.address) as channel:
        yield pb_grpc.GenerateServiceStub(channel)


def test_coordinator_sigkill_fails_no_request_and_it_comes_back(
        cluster: Cluster, stub: pb_grpc.GenerateServiceStub, metrics_port: int) -> None:
    streams = [start_stream(stub, 300, f"p{i}") for i in range(4)]
    assert all(s.first.wait(60) for s in streams)
    traffic = Traffic(stub)
    old = child_pid(cluster, "coordinator")
    killed_at = time.monotonic()
    os.kill(old, signal.SIGKILL)
    with grpc.insecure_channel(cluster.coordinator_address) as to_coordinator:
        health = health_pb2_grpc.HealthStub(to_coordinator)
        back_s = wait_for(succeeds(lambda: health.Check(
            health_pb2.HealthCheckRequest(), timeout=1).status == SERVING), 30,
            "the coordinator to be back on its port")

    def not_degraded() -> bool:
        info = stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=5)
        return not info.degraded and info.num_engines == 2

    healed_s = wait_for(not_degraded, 30, "the frontend to leave degraded mode") + back_s
    wait_all(streams, 120)
    traffic.stop()
    print(f"\ncoordinator SIGKILL: back on its port after {back_s:.2f} s, frontend not "
          f"degraded after {healed_s:.2f} s; {traffic.ok} new requests, "
          f"{len(streams)} streams, no failure")
    assert [s.code for s in streams] == [grpc.StatusCode.OK] * len(streams), \
        [s.details for s in streams]
    assert not traffic.failures and traffic.ok > 0, traffic.failures
    assert child_pid(cluster, "coordinator") != old
    assert time.monotonic() - killed_at < 30
    assert "coordinator exited unexpectedly with code -9 (SIGKILL); restart 1" in log(cluster)
    with urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics") as reply:
        metrics = reply.read().decode()
    assert ('corestream:serve_restarts_total{part="coordinator",process="serve"} 1.0'
            in metrics)
    assert 'corestream:serve_restarts_total{part="engine-1",process="serve"} 0.0' in metrics
    coordinator = next(r for r in admin_stats(cluster.address) if r.get("part") == "coordinator")
    assert coordinator["restarts"] == 1 and coordinator["last_exit"] == "code -9 (SIGKILL)"


def test_engine_sigkill_mid_stream_others_serve_and_it_comes_back_on_its_rank(
        cluster: Cluster, stub: pb_grpc.GenerateServiceStub) -> None:
    streams = [start_stream(stub, 600, f"s{i}") for i in range(4)]
    assert all(s.first.wait(60) and s.code is None for s in streams)
    traffic = Traffic(stub)
    killed_at = time.monotonic()
    os.kill(cluster.engine_pid(1), signal.SIGKILL)
    wait_all(streams, 60)
    cut = [s for s in streams if s.code is not grpc.StatusCode.OK]
    assert cut and all(s.code is grpc.StatusCode.UNAVAILABLE and "dp=1" in s.details
                       for s in cut), [(s.code, s.details) for s in streams]
    cut_s = max(s.ended_at - killed_at for s in cut)
    assert cut_s < DEATH_TO_UNAVAILABLE_S
    back_s = wait_for(succeeds(lambda: generate(stub, "rank 1", rank=1, timeout=10)),
                      ENGINE_BACK_S, "the killed engine to serve again")
    traffic.stop()
    noticed_at = min(s.ended_at for s in cut)
    print(f"\nengine SIGKILL: {len(cut)} streams ended UNAVAILABLE within {cut_s:.2f} s "
          f"(the frontend noticed after {noticed_at - killed_at:.3f} s); engine 1 took "
          f"requests again after {back_s:.2f} s; {traffic.ok} new requests meanwhile, "
          f"{len(traffic.failures)} failed (on engine 1 when it died)")
    # Requests go one at a time: the one on engine 1 when it died fails like its streams
    # if it had produced a token already; one with no output yet (routed there before
    # the frontend saw the Session break, too) runs again on engine 0.
    assert len(traffic.failures) <= 1, traffic.failures
    assert all("dp=1" in message for _, message in traffic.failures), traffic.failures
    assert not traffic.failed_after(noticed_at) and traffic.ok > 0, traffic.failures
    assert "engine-1 exited unexpectedly with code -9 (SIGKILL); restart 1" in log(cluster)
    [engine1] = [r for r in admin_stats(cluster.address) if r.get("engine_index") == 1]
    assert engine1["ok"] and engine1["restarts"] == 1


def test_frontend_sigkill_comes_back_on_its_port(
        cluster: Cluster, stub: pb_grpc.GenerateServiceStub) -> None:
    old = child_pid(cluster, "frontend")
    os.kill(old, signal.SIGKILL)
    # The same channel: the client's own reconnects find the new process.
    back_s = wait_for(succeeds(lambda: generate(stub, "again", timeout=10)), 60,
                      "the frontend to serve on its port again")
    print(f"\nfrontend SIGKILL: serving on {cluster.address} again after {back_s:.2f} s")
    assert child_pid(cluster, "frontend") != old
    assert "frontend exited unexpectedly with code -9 (SIGKILL); restart 1" in log(cluster)


def test_sigterm_during_a_restart_stops_everything(cluster: Cluster) -> None:
    before = descendants(cluster.proc.pid)
    starts = log(cluster).count("starting engine-0:")
    os.kill(cluster.engine_pid(0), signal.SIGKILL)
    wait_for(lambda: log(cluster).count("starting engine-0:") > starts, 30,
             "serve to restart engine 0")
    # serve logs the start just before it spawns the process: wait for the process too.
    wait_for(lambda: bool(descendants(cluster.proc.pid) - before), 30,
             "the new engine 0 process")
    restarting = descendants(cluster.proc.pid) - before  # the new engine, still loading
    code = cluster.stop(signal.SIGTERM, timeout=60)
    assert code == 0, cluster.output()
    left = [p for p in before | restarting if alive(p)]
    assert not left, f"processes left behind: {left}\n{cluster.output()}"


@pytest.mark.timeout(300)
def test_an_engine_crashing_on_start_is_given_up_and_serve_serves_on() -> None:
    c = Cluster(["--engines", "2", "--max-restarts", "1", "--restart-backoff-max-s", "1"],
                env={FAULT_INJECT: "crash_at_start@1"})
    try:
        out = log(c)
        assert out.count("engine-1 exited unexpectedly with code 1; restart") == 1, out
        assert "engine-1 exited unexpectedly with code 1; giving it up: 2 exits within" in out
        assert "serving on without engine-1, on 1 engine(s)" in out
        assert "injected crash at start" in out
        with grpc.insecure_channel(c.address) as channel:
            stub = pb_grpc.GenerateServiceStub(channel)
            info = stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=5)
            assert info.num_engines == 1 and list(info.engines_given_up) == ["engine-1"], info
            assert all(generate(stub, f"p{i}").usage.completion_tokens == 4 for i in range(3))
        stats = {r.get("engine_index", r.get("part")): r for r in admin_stats(c.address)}
        assert stats[0]["ok"] and stats[0]["restarts"] == 0
        assert not stats[1]["ok"] and "gave up on engine-1" in stats[1]["message"], stats
    finally:
        code = c.stop()
    assert code == 0, c.output()



@pytest.mark.slow
@pytest.mark.timeout(400)
def test_a_killed_first_moe_rank_restarts_its_whole_group(moe_checkpoint: Path) -> None:
    """The first rank hosts the group's rendezvous: the others cannot re-form without it
    (a later rank is replaced alone: test_moe_waves)."""
    c = Cluster(["--model", str(moe_checkpoint), "--engines", "2", "--wave-check-interval",
                 "4", "--data-parallel-timeout", "15", "--kv-cache-memory", "16MiB"],
                env={"OMP_NUM_THREADS": "1"})
    try:
        with grpc.insecure_channel(c.address) as channel:
            stub = pb_grpc.GenerateServiceStub(channel)
            for rank in (0, 1):  # the group has run waves before
                generate(stub, "before", rank=rank)
            ranks = {0: c.engine_pid(0), 1: c.engine_pid(1)}
            os.kill(ranks[0], signal.SIGKILL)
            back_s = wait_for(succeeds(lambda: [generate(stub, "moe", rank=r, timeout=30)
                                                for r in (0, 1)]), 120,
                              "both ranks to serve again")
            print(f"\nMoE rank SIGKILL: the group served again after {back_s:.2f} s")
            assert not alive(ranks[1]) and c.engine_pid(1) != ranks[1]  # restarted too
            assert ("engines exited unexpectedly with code -9 (SIGKILL) (engine-0); restart 1"
                    in log(c))
    finally:
        assert c.stop() == 0, c.output()
