"""Fault-test helpers: streams consumed on threads with the times of what happened,
and a cluster whose processes are all killed whatever the test leaves alive."""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import grpc
from corestream.common.v1 import common_pb2
from corestream.generate.v1 import generate_service_pb2 as pb
from corestream.generate.v1 import generate_service_pb2_grpc as pb_grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from services.engine.executor.fault_injection import ENV_VAR as FAULT_INJECT
from tests.integration.cluster import Cluster, alive, descendants

SERVICE = "corestream.generate.v1.GenerateService"
# The bound on death -> UNAVAILABLE.
DEATH_TO_UNAVAILABLE_S = 5.0


@dataclass
class Stream:
    """A GenerateStream consumed on a thread, with the times of what happened."""

    chunks: int = 0
    last_chunk_at: float = 0.0
    code: grpc.StatusCode | None = None
    details: str = ""
    ended_at: float = 0.0
    first: threading.Event = field(default_factory=threading.Event)
    done: threading.Event = field(default_factory=threading.Event)


def start_stream(stub: pb_grpc.GenerateServiceStub, max_tokens: int, text: str = "x",
                 rank: int | None = None) -> Stream:
    s = Stream()
    request = pb.GenerateStreamRequest(text=text, data_parallel_rank=rank, sampling=(
        common_pb2.SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)))

    def consume() -> None:
        try:
            for _ in stub.GenerateStream(request, timeout=180):
                s.chunks += 1
                s.last_chunk_at = time.monotonic()
                s.first.set()
            s.code = grpc.StatusCode.OK
        except grpc.RpcError as e:
            s.code, s.details = e.code(), e.details() or ""
        s.ended_at = time.monotonic()
        s.first.set()
        s.done.set()

    threading.Thread(target=consume, daemon=True).start()
    return s


def wait_all(streams: list[Stream], timeout: float) -> None:
    deadline = time.monotonic() + timeout
    for s in streams:
        assert s.done.wait(max(0.0, deadline - time.monotonic())), "a stream hung"


def wait_for(check: Callable[[], bool], timeout: float, what: str) -> float:
    """Seconds until `check` held."""
    started = time.monotonic()
    while not check():
        assert time.monotonic() - started < timeout, f"timed out waiting for {what}"
        time.sleep(0.05)
    return time.monotonic() - started


def readiness(channel: grpc.Channel) -> int:
    return health_pb2_grpc.HealthStub(channel).Check(
        health_pb2.HealthCheckRequest(service=SERVICE), timeout=5).status


@contextmanager
def cluster(args: list[str], fault: str = "") -> Iterator[tuple[Cluster, set[int]]]:
    """A cluster and its processes; whatever a test leaves alive is killed."""
    c = Cluster(args, env={FAULT_INJECT: fault} if fault else None)
    children = descendants(c.proc.pid)
    try:
        yield c, children
    finally:
        c.stop(timeout=30)
        for pid in children:
            if alive(pid):
                os.kill(pid, signal.SIGKILL)
