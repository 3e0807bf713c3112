"""How the real cluster fails: engine death (exception, SIGKILL), a stuck or frozen
engine (watchdog), SIGTERM drain and the death of `corestream serve` itself, with
serve's restarts off (--max-restarts 0; test_serve_healing.py covers them).

Faults come from the test-only CORESTREAM_FAULT_INJECT variable (see
services/engine/executor/fault_injection.py) and from signals sent to the real processes.
Every test prints the times it measured (run with -s to see them).
"""

from __future__ import annotations

import json
import os
import signal
import time
from collections.abc import Callable

import grpc
import pytest
from corestream.common.v1 import common_pb2
from corestream.generate.v1 import admin_service_pb2 as admin_pb
from corestream.generate.v1 import admin_service_pb2_grpc as admin_grpc
from corestream.generate.v1 import generate_service_pb2 as pb
from corestream.generate.v1 import generate_service_pb2_grpc as pb_grpc
from grpc_health.v1 import health_pb2

from tests.integration.cluster import Cluster, alive
from tests.integration.faults import (
    DEATH_TO_UNAVAILABLE_S,
    cluster,
    readiness,
    start_stream,
    wait_all,
    wait_for,
)


def waiting_on(admin: admin_grpc.AdminServiceStub, engine_index: int) -> int:
    reply = admin.GetEngineStats(admin_pb.GetEngineStatsRequest(engine_index=engine_index),
                                 timeout=20)
    assert all(r.ok for r in reply.results), reply
    return int(json.loads(reply.results[0].result_json)["num_waiting"])


def exit_code_logged(c: Cluster, name: str) -> Callable[[], bool]:
    return lambda: f"{name} exited unexpectedly with code" in c.output()


@pytest.mark.timeout(300)
def test_engine_death_by_exception_and_by_sigkill() -> None:
    # Without restarts (test_serve_healing.py covers them): a dead engine stays dead.
    with cluster(["--engines", "2", "--shutdown-timeout", "5", "--max-restarts", "0"],
                 fault="raise_after_steps:40@0") as (c, children):
        with grpc.insecure_channel(c.address) as channel:
            stub = pb_grpc.GenerateServiceStub(channel)
            # The fault counts engine 0's steps from its first request on: held paused
            # until all three of its streams are queued there, none can come after the
            # death (on a loaded machine the third one did, and got "down or draining").
            admin = admin_grpc.AdminServiceStub(channel)
            paused = admin.PauseScheduling(admin_pb.PauseSchedulingRequest(
                engine_index=0, mode=admin_pb.PAUSE_MODE_WAIT), timeout=20)
            assert all(r.ok for r in paused.results), paused
            # Pinned, so that both engines hold streams whatever the routing policy does.
            streams = [start_stream(stub, 400, f"p{i}", rank=i % 2) for i in range(6)]
            wait_for(lambda: waiting_on(admin, 0) == 3, 60, "engine 0's streams to queue")
            resumed = admin.ResumeScheduling(
                admin_pb.ResumeSchedulingRequest(engine_index=0), timeout=20)
            assert all(r.ok for r in resumed.results), resumed
            wait_all(streams, 120)
            failed = [s for s in streams if s.code is not grpc.StatusCode.OK]
            assert failed == streams[::2], [(s.code, s.details) for s in streams]
            # The last chunk came at most a step before the death: an upper bound.
            latencies = [s.ended_at - s.last_chunk_at for s in failed if s.chunks]
            print(f"\nexception: death -> UNAVAILABLE <= {max(latencies):.3f} s "
                  f"({len(failed)} streams)")
            for s in failed:
                assert s.code is grpc.StatusCode.UNAVAILABLE
                assert "engine-core dp=0" in s.details and "injected fault" in s.details
            assert max(latencies) < DEATH_TO_UNAVAILABLE_S
            wait_for(exit_code_logged(c, "engine-0"), 30, "engine 0 to exit")
            assert "engine-0 exited unexpectedly with code 1" in c.output()
            # The survivor serves new requests.
            for i in range(3):
                reply = stub.Generate(pb.GenerateRequest(text=f"q{i}", sampling=(
                    common_pb2.SamplingParams(max_tokens=4, ignore_eos=True))), timeout=60)
                assert reply.usage.completion_tokens == 4
            assert readiness(channel) == health_pb2.HealthCheckResponse.SERVING

            running = start_stream(stub, 1500)
            assert running.first.wait(60) and running.code is None
            killed_at = time.monotonic()
            os.kill(c.engine_pid(1), signal.SIGKILL)
            assert running.done.wait(30)
            latency = running.ended_at - killed_at
            print(f"SIGKILL: death -> UNAVAILABLE {latency:.3f} s")
            assert running.code is grpc.StatusCode.UNAVAILABLE
            assert "engine-core dp=1" in running.details
            assert latency < DEATH_TO_UNAVAILABLE_S
        # No engine left (none is restarted): serve stops the cluster and says so with
        # its exit code.
        assert c.proc.wait(60) == 1, c.output()
        wait_for(lambda: not any(alive(p) for p in children), 30, "every process to exit")


@pytest.mark.timeout(300)
def test_watchdog_stuck_and_frozen_engines_then_serve_sigkill() -> None:
    timeout_s = 3.0
    args = ["--engines", "2", "--watchdog-timeout", str(timeout_s), "--shutdown-timeout", "5",
            "--max-restarts", "0"]  # the stuck engine stays dead
    with cluster(args, fault="hang_after_steps:300@0") as (c, children), \
            grpc.insecure_channel(c.address) as channel:
        stub = pb_grpc.GenerateServiceStub(channel)
        time.sleep(3 * timeout_s)  # idle engines never trip their watchdogs
        assert readiness(channel) == health_pb2.HealthCheckResponse.SERVING
        assert stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=5).num_engines == 2

        # Each engine's streams are pinned to it and the frozen engine's start (and are
        # frozen) first: the tiny model makes ~1,000 tokens a second, so a stream routed
        # freely to engine 1 could finish before the freeze while we wait for the others.
        engine1 = c.engine_pid(1)
        frozen_streams = [start_stream(stub, 2000, f"f{i}", rank=1) for i in range(3)]
        for s in frozen_streams:
            assert s.first.wait(60) and s.code is None, s.details
        os.kill(engine1, signal.SIGSTOP)  # alive but frozen, watchdog thread included
        stopped_at = time.monotonic()
        assert not any(s.done.is_set() for s in frozen_streams)
        # Long enough that the stuck engine hangs (after 300 steps) before any finishes.
        streams = [start_stream(stub, 1000, f"p{i}", rank=0) for i in range(3)]
        for s in streams:
            assert s.first.wait(60) and s.code is None, s.details
        streams += frozen_streams
        wait_all(streams, 60)
        stuck = [s for s in streams if "dp=0" in s.details]
        frozen = [s for s in streams if "dp=1" in s.details]
        assert stuck and frozen and len(stuck) + len(frozen) == len(streams), \
            [(s.code, s.details) for s in streams]
        assert all(s.code is grpc.StatusCode.UNAVAILABLE and "watchdog" in s.details
                   for s in streams)
        stuck_s = max(s.ended_at - s.last_chunk_at for s in stuck)
        frozen_s = max(s.ended_at - stopped_at for s in frozen)
        print(f"\nwatchdog (stuck step, engine side): <= {stuck_s:.2f} s; "
              f"frozen engine (SIGSTOP, frontend side): {frozen_s:.2f} s; "
              f"timeout {timeout_s:g} s")
        assert stuck_s <= timeout_s + 2 and frozen_s <= timeout_s + 2
        wait_for(exit_code_logged(c, "engine-0"), 30, "engine 0 to exit")
        out = c.output()
        assert "engine-0 exited unexpectedly with code 1" in out
        assert "most recent call first" in out and "fault_injection.py" in out  # stacks

        # Thawed, the engine answers its Session again and takes requests.
        os.kill(engine1, signal.SIGCONT)

        def served() -> bool:
            try:
                stub.Generate(pb.GenerateRequest(text="hi", sampling=(
                    common_pb2.SamplingParams(max_tokens=2))), timeout=10)
                return True
            except grpc.RpcError:
                return False

        wait_for(served, 60, "the thawed engine to serve")

        running = start_stream(stub, 1500)
        assert running.first.wait(60)
        os.kill(c.proc.pid, signal.SIGKILL)  # serve dies; its children must follow
        gone_s = wait_for(lambda: not any(alive(p) for p in children), 30,
                          "every process to exit after serve's SIGKILL")
        print(f"serve SIGKILL: every process gone after {gone_s:.2f} s")
        # The orphaned processes drained on their PR_SET_PDEATHSIG SIGTERM.
        assert running.done.wait(10)
        assert running.code in (grpc.StatusCode.OK, grpc.StatusCode.UNAVAILABLE)


@pytest.mark.timeout(300)
def test_sigterm_drains_fifty_streams_and_exits_zero() -> None:
    drain_s = 5.0
    # Every step takes at least 10 ms, so no long stream can make its remaining tokens
    # within the drain, however fast the CPU (the tiny model alone makes 1500 tokens in
    # under 5 s on some), while the short ones need only ~20 steps of it.
    step_ms, long_tokens = 10, 1500
    with cluster(["--shutdown-timeout", str(drain_s)], fault=f"slow_steps:{step_ms}") as (
            c, children):
        with grpc.insecure_channel(c.address) as channel:
            stub = pb_grpc.GenerateServiceStub(channel)
            streams = [start_stream(stub, 20 if i % 2 else long_tokens, f"p{i}")
                       for i in range(50)]
            for s in streams:
                assert s.first.wait(120), "a stream never started"
            sigterm_at = time.monotonic()
            most = max(s.chunks for s in streams[::2])
            # The precondition of "cut": what is left exceeds what the drain can make.
            assert long_tokens - most > (drain_s + 3) * 1000 / step_ms, most
            c.proc.send_signal(signal.SIGTERM)
            time.sleep(1.5)  # serve passes SIGTERM on to the frontend first
            with pytest.raises(grpc.RpcError) as refused:
                stub.Generate(pb.GenerateRequest(text="late"), timeout=10)
            assert refused.value.code() is grpc.StatusCode.UNAVAILABLE
            assert "draining" in (refused.value.details() or "")
            wait_all(streams, drain_s + 30)
        code = c.proc.wait(60)
        exited_s = time.monotonic() - sigterm_at
        finished = [s for s in streams if s.code is grpc.StatusCode.OK]
        cut = [s for s in streams if s.code is not grpc.StatusCode.OK]
        last_end = max(s.ended_at for s in streams) - sigterm_at
        print(f"\nSIGTERM drain: {len(finished)} finished, {len(cut)} ended UNAVAILABLE, "
              f"last stream ended {last_end:.2f} s after SIGTERM (timeout {drain_s:g} s), "
              f"serve exited after {exited_s:.2f} s")
        assert code == 0, c.output()
        assert all(s.code is grpc.StatusCode.UNAVAILABLE and "shutting down" in s.details
                   for s in cut), {(s.code, s.details) for s in cut}
        assert finished and cut
        assert last_end <= drain_s + 2
        wait_for(lambda: not any(alive(p) for p in children), 10, "every process to exit")
