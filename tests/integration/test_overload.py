"""Overload on loopback: more concurrent streams than an engine admits.

The engine runs 2 requests at a time (--max-num-seqs) and lets 2 more wait
(--max-waiting-requests); a burst of BURST streams must see the excess refused at
once with RESOURCE_EXHAUSTED and a retry hint, the admitted ones complete, and the
processes' memory stay flat over repeated bursts. Run with -s for the figures.
"""

from __future__ import annotations

import asyncio
import statistics
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest
from corestream.common.v1 import common_pb2
from corestream.generate.v1 import generate_service_pb2 as pb
from corestream.generate.v1 import generate_service_pb2_grpc as pb_grpc

from services.frontend.errors import RETRY_AFTER_KEY
from tests.integration.cluster import Cluster, descendants

BURST = 48
BURSTS = 4
MAX_TOKENS = 160
MAX_RUNNING = 2
MAX_WAITING = 2
# Generous for a loaded 2-core machine; a refusal takes milliseconds when idle.
REFUSAL_BOUND_S = 5.0
RSS_GROWTH_BOUND_MIB = 64.0

pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def cluster() -> Iterator[Cluster]:
    c = Cluster(["--max-num-seqs", str(MAX_RUNNING),
                 "--max-waiting-requests", str(MAX_WAITING)])
    yield c
    c.stop()


@dataclass
class Outcome:
    code: grpc.StatusCode
    seconds: float
    tokens: int = 0
    retry_after_ms: str = ""
    details: str = ""


async def one_stream(stub: pb_grpc.GenerateServiceStub, i: int) -> Outcome:
    request = pb.GenerateStreamRequest(text=f"request {i}", sampling=common_pb2.SamplingParams(
        max_tokens=MAX_TOKENS, ignore_eos=True, temperature=0.0))
    started = time.monotonic()
    tokens = 0
    try:
        async for chunk in stub.GenerateStream(request, timeout=120):
            tokens += len(chunk.token_ids)
    except grpc.aio.AioRpcError as e:
        trailers = dict(e.trailing_metadata() or ())
        return Outcome(e.code(), time.monotonic() - started,
                       retry_after_ms=str(trailers.get(RETRY_AFTER_KEY, "")),
                       details=e.details() or "")
    return Outcome(grpc.StatusCode.OK, time.monotonic() - started, tokens)


async def burst(address: str) -> list[Outcome]:
    # Two connections, so that the burst is not bounded by one connection's streams.
    channels = [grpc.aio.insecure_channel(address) for _ in range(2)]
    try:
        stubs = [pb_grpc.GenerateServiceStub(ch) for ch in channels]
        return await asyncio.gather(*(one_stream(stubs[i % 2], i) for i in range(BURST)))
    finally:
        for ch in channels:
            await ch.close()


def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise LookupError(pid)


def frontend_pid(cluster: Cluster) -> int:
    for pid in descendants(cluster.proc.pid):
        argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        if b"frontend" in argv:
            return pid
    raise LookupError("no frontend below serve")


def test_overload_is_refused_fast_and_memory_stays_bounded(cluster: Cluster) -> None:
    pids = {"frontend": frontend_pid(cluster), "engine": cluster.engine_pid(0)}
    rss_before = {name: rss_mib(pid) for name, pid in pids.items()}
    rss_after_first: dict[str, float] = {}
    refused: list[Outcome] = []
    admitted: list[Outcome] = []
    for i in range(BURSTS):
        outcomes = asyncio.run(burst(cluster.address))
        unexpected = [o for o in outcomes
                      if o.code not in (grpc.StatusCode.OK, grpc.StatusCode.RESOURCE_EXHAUSTED)]
        assert not unexpected, unexpected[:3]
        refused += [o for o in outcomes if o.code is grpc.StatusCode.RESOURCE_EXHAUSTED]
        admitted += [o for o in outcomes if o.code is grpc.StatusCode.OK]
        if i == 0:
            rss_after_first = {name: rss_mib(pid) for name, pid in pids.items()}
    rss_after = {name: rss_mib(pid) for name, pid in pids.items()}

    refusal_s = sorted(o.seconds for o in refused)
    completion_s = sorted(o.seconds for o in admitted)
    print(f"\noverload: {BURSTS} bursts of {BURST} streams, engine max_num_seqs {MAX_RUNNING}, "
          f"max_waiting_requests {MAX_WAITING}, max_tokens {MAX_TOKENS}")
    print(f"  admitted {len(admitted)}, refused {len(refused)}")
    print(f"  refusal latency: median {statistics.median(refusal_s) * 1000:.0f} ms, "
          f"max {refusal_s[-1] * 1000:.0f} ms")
    print(f"  admitted completion: median {statistics.median(completion_s):.2f} s, "
          f"max {completion_s[-1]:.2f} s")
    for name in pids:
        print(f"  {name} RSS MiB: before {rss_before[name]:.0f}, after burst 1 "
              f"{rss_after_first[name]:.0f}, after burst {BURSTS} {rss_after[name]:.0f}")

    # Excess refused, with a message and a retry hint.
    assert len(refused) >= BURSTS * (BURST - 4 * (MAX_RUNNING + MAX_WAITING)), len(refused)
    assert all("max_waiting_requests" in o.details for o in refused), refused[0]
    assert {o.retry_after_ms for o in refused} == {"1000"}
    # ... at once: far sooner than an admitted request takes.
    assert refusal_s[-1] < REFUSAL_BOUND_S
    assert statistics.median(refusal_s) < statistics.median(completion_s)
    # Admitted ones complete in full.
    assert len(admitted) >= BURSTS * MAX_RUNNING
    assert all(o.tokens == MAX_TOKENS for o in admitted)
    # Repeated bursts leave no growing backlog behind.
    for name in pids:
        growth = rss_after[name] - rss_after_first[name]
        assert growth < RSS_GROWTH_BOUND_MIB, f"{name} RSS grew {growth:.0f} MiB"
    # And the engine serves normally once the burst has passed.
    with grpc.insecure_channel(cluster.address) as ch:
        reply = pb_grpc.GenerateServiceStub(ch).Generate(pb.GenerateRequest(
            text="after", sampling=common_pb2.SamplingParams(max_tokens=4, ignore_eos=True)),
            timeout=60)
    assert len(reply.completions[0].token_ids) == 4
