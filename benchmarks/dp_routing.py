"""Data-parallel dense engines: throughput with 1 vs 2 engines, and routing balance.

    .venv/bin/python benchmarks/dp_routing.py                       # both parts
    .venv/bin/python benchmarks/dp_routing.py --num-requests 16 --burst 100

Each part runs `corestream serve --engines N` (real processes, gRPC) on the
benchmark checkpoint (benchmarks/workload.py).

- Throughput: the same seeded workload (default 48 requests, prompts 16-128
  tokens, outputs 16-64, greedy, ignore_eos) streamed all at once through the
  frontend, after a warm-up, with 1 and then 2 engines. On a machine with few
  cores the engines compete for them (each runs torch on every core), so the
  ratio says as much about the CPU as about the routing.
- Balance: a burst of `--burst` concurrent short requests (prompt PROMPT_LEN
  tokens, 4 output tokens) on 2 engines; requests per engine come from each
  engine's statistics (AdminService GetEngineStats: every admitted request adds
  its prompt length to prefix_cache_queries). Prints max/min per engine.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import time
from pathlib import Path

# Runnable as a script from anywhere: the repository root is the import root.
ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "protos"), str(ROOT / "kernels")]

from benchmarks.throughput import stream_all  # noqa: E402
from benchmarks.workload import VOCAB, BenchRequest, bench_checkpoint, warmup_workload  # noqa: E402

PROMPT_LEN = 16


def small_workload(num_requests: int, seed: int = 0) -> list[BenchRequest]:
    """Prompt lengths 16-128, output lengths 16-64, random token ids."""
    rng = random.Random(seed)
    return [
        BenchRequest(prompt=[rng.randrange(3, VOCAB) for _ in range(rng.randint(16, 128))],
                     max_tokens=rng.randint(16, 64))
        for _ in range(num_requests)
    ]


def admitted_per_engine(address: str) -> dict[int, int]:
    """Requests each engine has admitted, from prefix_cache_queries (PROMPT_LEN each)."""
    import grpc
    from corestream.generate.v1 import admin_service_pb2 as admin_pb
    from corestream.generate.v1 import admin_service_pb2_grpc as admin_grpc

    with grpc.insecure_channel(address) as channel:
        reply = admin_grpc.AdminServiceStub(channel).GetEngineStats(
            admin_pb.GetEngineStatsRequest(), timeout=30)
    return {r.engine_index: json.loads(r.result_json)["prefix_cache_queries"] // PROMPT_LEN
            for r in reply.results}


def serve(model: Path, engines: int, args: argparse.Namespace):  # type: ignore[no-untyped-def]
    from tests.integration.cluster import Cluster

    return Cluster(["--model", str(model), "--engines", str(engines),
                    "--kv-cache-memory", args.kv_cache_memory, "--log-level", "warning"])


def throughput(model: Path, engines: int, args: argparse.Namespace) -> tuple[float, int]:
    workload = small_workload(args.num_requests)
    cluster = serve(model, engines, args)
    try:
        asyncio.run(stream_all(cluster.address, warmup_workload(4)))
        start = time.perf_counter()
        generated = asyncio.run(stream_all(cluster.address, workload))
        seconds = time.perf_counter() - start
    finally:
        cluster.stop()
    assert generated == sum(r.max_tokens for r in workload), generated
    return seconds, generated


def balance(model: Path, args: argparse.Namespace) -> dict[int, int]:
    rng = random.Random(7)
    burst = [BenchRequest([rng.randrange(3, VOCAB) for _ in range(PROMPT_LEN)], 4)
             for _ in range(args.burst)]
    cluster = serve(model, 2, args)
    try:
        before = admitted_per_engine(cluster.address)
        asyncio.run(stream_all(cluster.address, burst))
        after = admitted_per_engine(cluster.address)
    finally:
        cluster.stop()
    counts = {rank: after[rank] - before.get(rank, 0) for rank in after}
    assert sum(counts.values()) == args.burst, counts
    return counts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--num-requests", type=int, default=48)
    parser.add_argument("--burst", type=int, default=200)
    parser.add_argument("--kv-cache-memory", default="256MiB")
    parser.add_argument("--skip-throughput", action="store_true")
    parser.add_argument("--skip-balance", action="store_true")
    args = parser.parse_args()
    model = bench_checkpoint()

    if not args.skip_throughput:
        results = {n: throughput(model, n, args) for n in (1, 2)}
        for n, (seconds, tokens) in results.items():
            print(f"{n} engine(s): {args.num_requests} requests, {tokens} output tokens in "
                  f"{seconds:.1f} s = {tokens / seconds:.1f} output tokens/s")
        speedup = results[1][0] / results[2][0]
        print(f"2 engines vs 1: {speedup:.2f}x throughput")
    if not args.skip_balance:
        counts = balance(model, args)
        spread = max(counts.values()) / max(min(counts.values()), 1)
        print(f"burst of {args.burst} on 2 engines: requests per engine {counts}, "
              f"max/min {spread:.2f}")


if __name__ == "__main__":
    main()
