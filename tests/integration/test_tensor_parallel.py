"""Tensor parallelism through the real cluster: `corestream serve --tensor-parallel-size 2`
gives the same greedy tokens as one rank, its ranks run on CPUs of their own, and a
worker that dies, raises or hangs makes its engine DEAD (every stream on it ends
UNAVAILABLE naming the engine and the worker, within the bound) while the rest of the
cluster serves on and no process is left behind.

Run with -s to see the times measured.
"""

from __future__ import annotations

import os
import signal
import time
import urllib.request
from pathlib import Path

import grpc
import pytest
from corestream.common.v1 import common_pb2
from corestream.generate.v1 import generate_service_pb2 as pb
from corestream.generate.v1 import generate_service_pb2_grpc as pb_grpc
from prometheus_client.parser import text_string_to_metric_families

from services.common.ports import free_port
from tests.integration.cluster import alive, descendants
from tests.integration.faults import (
    DEATH_TO_UNAVAILABLE_S,
    cluster,
    start_stream,
    wait_all,
    wait_for,
)

PROMPTS = ["The quick brown fox", "tensor parallel", "x"]


def greedy(stub: pb_grpc.GenerateServiceStub, text: str) -> list[int]:
    reply = stub.Generate(pb.GenerateRequest(text=text, sampling=common_pb2.SamplingParams(
        temperature=0.0, max_tokens=24, ignore_eos=True)), timeout=60)
    return list(reply.completions[0].token_ids)


def workers_of(pid: int) -> list[int]:
    """The tensor-parallel worker processes below engine `pid` (not multiprocessing's
    resource tracker)."""
    return sorted(p for p in descendants(pid)
                  if b"spawn_main" in Path(f"/proc/{p}/cmdline").read_bytes())


def scrape(port: int) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Engine 0's samples by name and labels (model_name and engine left out), from
    serve's endpoint for the cluster."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as response:
        text = response.read().decode()
    return {(s.name, tuple(sorted((k, v) for k, v in s.labels.items()
                                  if k not in ("model_name", "engine", "process")))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples
            if s.labels.get("process") == "engine-0"}


def cpus_of(pid: int) -> str:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("Cpus_allowed_list:"):
            return line.split(":", 1)[1].strip()
    raise AssertionError(f"no Cpus_allowed_list for {pid}")


@pytest.mark.timeout(300)
def test_two_ranks_give_the_tokens_of_one() -> None:
    with cluster([]) as (c, _), grpc.insecure_channel(c.address) as channel:
        stub = pb_grpc.GenerateServiceStub(channel)
        expected = [greedy(stub, p) for p in PROMPTS]
        assert stub.GetModelInfo(pb.GetModelInfoRequest()).tensor_parallel_size == 1
    metrics_port = free_port()
    with cluster(["--tensor-parallel-size", "2", "--metrics-port", str(metrics_port)]) \
            as (c, children), grpc.insecure_channel(c.address) as channel:
        stub = pb_grpc.GenerateServiceStub(channel)
        assert [greedy(stub, p) for p in PROMPTS] == expected
        # engine -> coordinator (registration) -> frontend (load snapshot)
        assert stub.GetModelInfo(pb.GetModelInfoRequest()).tensor_parallel_size == 2
        samples = scrape(metrics_port)
        assert samples[("corestream:tensor_parallel_size", ())] == 2
        calls = [samples[("corestream:tensor_parallel_calls_total", (("rank", r),))]
                 for r in "01"]
        assert calls[0] >= calls[1] > 0  # the worker finished (nearly) every call sent
        engine = c.engine_pid(0)
        (worker,) = workers_of(engine)
        if len(os.sched_getaffinity(0)) >= 2:  # each rank on CPUs of its own
            assert not set(cpus_of(engine).split(",")) & set(cpus_of(worker).split(","))
        assert "tensor parallel over 2 ranks" in c.output()
        # SIGTERM drains as at one rank: a clean exit, the worker stopped, nothing left.
        running = start_stream(stub, 400, "drained")
        assert running.first.wait(60)
        assert c.stop(signal.SIGTERM, timeout=60) == 0, c.output()
        assert running.done.wait(10) and running.code is grpc.StatusCode.OK, running.details
        assert "tensor-parallel rank 1 stopping" in c.output()
        wait_for(lambda: not any(alive(p) for p in children), 30, "every process to exit")


@pytest.mark.timeout(300)
def test_a_hung_worker_and_a_killed_worker_each_kill_only_their_engine() -> None:
    timeout_s = 3.0
    args = ["--engines", "2", "--tensor-parallel-size", "2", "--watchdog-timeout",
            str(timeout_s), "--shutdown-timeout", "5", "--max-restarts", "0"]
    with cluster(args, fault="worker_hang_after_steps:200@0") as (c, children), \
            grpc.insecure_channel(c.address) as channel:
        stub = pb_grpc.GenerateServiceStub(channel)
        engine0, engine1 = c.engine_pid(0), c.engine_pid(1)
        group0 = {engine0, *descendants(engine0)}
        stuck = [start_stream(stub, 1500, f"s{i}", rank=0) for i in range(2)]
        fine = [start_stream(stub, 300, f"f{i}", rank=1) for i in range(2)]
        wait_all(stuck + fine, 120)
        for s in stuck:
            assert s.code is grpc.StatusCode.UNAVAILABLE, s.details
            assert "engine-core dp=0" in s.details and "watchdog" in s.details
            assert "tensor-parallel worker 1" in s.details and "did not finish" in s.details
        assert all(s.code is grpc.StatusCode.OK for s in fine), [s.details for s in fine]
        hang_s = max(s.ended_at - s.last_chunk_at for s in stuck)
        print(f"\nhung worker: last chunk -> UNAVAILABLE {hang_s:.2f} s "
              f"(watchdog {timeout_s:g} s)")
        assert hang_s < timeout_s + 2
        # The dead engine's processes are all gone, its hung worker included.
        wait_for(lambda: not any(alive(p) for p in group0), 30, "engine 0's processes to exit")
        assert greedy(stub, "still serving")  # on engine 1

        running = start_stream(stub, 1500, "k", rank=1)
        assert running.first.wait(60) and running.code is None
        (worker,) = workers_of(engine1)
        killed_at = time.monotonic()
        os.kill(worker, signal.SIGKILL)
        assert running.done.wait(30)
        latency = running.ended_at - killed_at
        print(f"SIGKILL of a worker -> UNAVAILABLE {latency:.3f} s")
        assert running.code is grpc.StatusCode.UNAVAILABLE
        assert "engine-core dp=1" in running.details
        assert f"tensor-parallel worker 1 (pid {worker}) was killed by SIGKILL" in running.details
        assert latency < DEATH_TO_UNAVAILABLE_S
        # No engine left: serve stops, and every process of the cluster is gone.
        assert c.proc.wait(60) == 1, c.output()
        wait_for(lambda: not any(alive(p) for p in children), 30, "every process to exit")


@pytest.mark.timeout(300)
def test_a_worker_that_raises_is_named() -> None:
    with cluster(["--tensor-parallel-size", "2", "--max-restarts", "0"],
                 fault="worker_raise_after_steps:100") as (c, children), \
            grpc.insecure_channel(c.address) as channel:
        stub = pb_grpc.GenerateServiceStub(channel)
        stream = start_stream(stub, 1500, "r")
        assert stream.done.wait(120)
        assert stream.code is grpc.StatusCode.UNAVAILABLE
        assert "engine-core dp=0" in stream.details
        assert "tensor-parallel worker 1" in stream.details
        assert "raised RuntimeError: injected fault in a worker" in stream.details
        assert stream.ended_at - stream.last_chunk_at < DEATH_TO_UNAVAILABLE_S
        assert c.proc.wait(60) == 1, c.output()
        wait_for(lambda: not any(alive(p) for p in children), 30, "every process to exit")

