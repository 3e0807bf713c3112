"""Cluster throughput with tracing at ratio 1.0 (to a live OTLP receiver) vs tracing off.

    .venv/bin/python benchmarks/tracing_overhead.py                  # 32 requests x 3 rounds
    .venv/bin/python benchmarks/tracing_overhead.py --num-requests 64 --rounds 5

Two `corestream serve` clusters run side by side on the benchmark checkpoint, one with
`--otlp-endpoint` (an in-process OTLP/gRPC receiver that keeps every span) and one
without; both also serve /metrics. The rounds alternate between them, so that drift of
the machine hits both. Prints each round's output tokens per second and the CPU seconds
its processes used (from their own `process_cpu_seconds_total`, steadier than wall time
on a shared machine), the medians and their ratios (traced / untraced).
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import time
import urllib.request
from pathlib import Path

# Runnable as a script from anywhere: the repository root is the import root.
ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "protos")]

from benchmarks.throughput import stream_all  # noqa: E402
from benchmarks.workload import bench_checkpoint, mixed_workload, warmup_workload  # noqa: E402
from tests.integration.cluster import Cluster, free_port  # noqa: E402
from tests.integration.otlp_collector import OtlpCollector  # noqa: E402


def start(model: Path, args: argparse.Namespace, otlp: str) -> tuple[Cluster, int]:
    extra = ["--otlp-endpoint", otlp, "--trace-sample-ratio", "1.0"] if otlp else []
    metrics_port = free_port()
    cluster = Cluster(["--model", str(model), "--max-num-seqs", str(args.max_num_seqs),
                       "--kv-cache-memory", args.kv_cache_memory, "--log-level", "warning",
                       "--metrics-port", str(metrics_port), *extra])
    return cluster, metrics_port


def cpu_seconds(metrics_port: int) -> float:
    """CPU time used so far by the coordinator, the frontend and the engine."""
    total = 0.0
    for port in (metrics_port, metrics_port + 1, metrics_port + 2):
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
            for line in r.read().decode().splitlines():
                if line.startswith("process_cpu_seconds_total "):
                    total += float(line.split()[1])
    return total


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--num-requests", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--max-num-seqs", type=int, default=256)
    parser.add_argument("--kv-cache-memory", default="1073741824")
    args = parser.parse_args()

    model = bench_checkpoint()
    workload = mixed_workload(args.num_requests)
    expected = sum(r.max_tokens for r in workload)
    collector = OtlpCollector().start()
    clusters = {"off": start(model, args, ""), "ratio 1.0": start(model, args, collector.endpoint)}
    tps: dict[str, list[float]] = {name: [] for name in clusters}
    cpu: dict[str, list[float]] = {name: [] for name in clusters}
    try:
        for cluster, _ in clusters.values():
            asyncio.run(stream_all(cluster.address, warmup_workload()))
        for round_ in range(args.rounds):
            for name, (cluster, metrics_port) in clusters.items():
                cpu_before = cpu_seconds(metrics_port)
                started = time.perf_counter()
                generated = asyncio.run(stream_all(cluster.address, workload))
                seconds = time.perf_counter() - started
                cpu[name].append(cpu_seconds(metrics_port) - cpu_before)
                assert generated == expected, (generated, expected)
                tps[name].append(generated / seconds)
                print(f"round {round_ + 1} tracing {name:9s}: {generated / seconds:8.1f} "
                      f"output tok/s ({seconds:.2f} s, {cpu[name][-1]:.2f} CPU s)", flush=True)
    finally:
        for cluster, _ in clusters.values():
            cluster.stop()
        collector.stop()
    off, on = (statistics.median(tps[name]) for name in clusters)
    cpu_off, cpu_on = (statistics.median(cpu[name]) for name in clusters)
    engine_spans = sum(s.name == "engine.request" for s in collector.spans)
    print(f"\n{args.num_requests} requests x {args.rounds} rounds, {expected} output tokens each")
    print(f"median output tok/s: tracing off {off:.1f}, tracing ratio 1.0 {on:.1f}; "
          f"ratio {on / off:.3f} ({(1 - on / off) * 100:+.1f}% cost)")
    print(f"median CPU s per round: tracing off {cpu_off:.2f}, tracing ratio 1.0 {cpu_on:.2f}; "
          f"ratio {cpu_on / cpu_off:.3f} ({(cpu_on / cpu_off - 1) * 100:+.1f}% cost)")
    print(f"spans received: {len(collector.spans)} ({engine_spans} engine request spans)")


if __name__ == "__main__":
    main()
