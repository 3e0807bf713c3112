"""Clusters that differ in one setting, timed on the same workload in alternating
rounds (so that drift of a shared machine hits each alike): output tokens per
second and the CPU seconds their processes used, from their own
`process_cpu_seconds_total` (steadier than wall time on a shared machine)."""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time
import urllib.request
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families

from benchmarks.throughput import stream_all
from benchmarks.workload import BenchRequest, warmup_workload
from tests.integration.cluster import Cluster, free_port


def parse_args(description: str) -> argparse.Namespace:
    """The flags every side-by-side benchmark takes."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--num-requests", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--max-num-seqs", type=int, default=256)
    parser.add_argument("--kv-cache-memory", default="1073741824")
    return parser.parse_args()


@dataclass
class Arm:
    """One cluster of the comparison and what its rounds measured."""

    name: str
    cluster: Cluster
    metrics_port: int
    tps: list[float] = field(default_factory=list)
    cpu: list[float] = field(default_factory=list)


def start(name: str, model: Path, max_num_seqs: int, kv_cache_memory: str,
          extra: Sequence[str] = ()) -> Arm:
    metrics_port = free_port()
    cluster = Cluster(["--model", str(model), "--max-num-seqs", str(max_num_seqs),
                       "--kv-cache-memory", kv_cache_memory, "--log-level", "warning",
                       "--metrics-port", str(metrics_port), *extra])
    return Arm(name, cluster, metrics_port)


def cpu_seconds(metrics_port: int) -> float:
    """CPU time used so far by the coordinator, the frontend and the engines: serve's
    endpoint labels each process's samples with `process`."""
    with urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=10) as r:
        families = text_string_to_metric_families(r.read().decode())
        return sum(sample.value for family in families for sample in family.samples
                   if sample.name == "process_cpu_seconds_total"
                   and sample.labels.get("process") != "serve")


def run_rounds(arms: Sequence[Arm], workload: list[BenchRequest], rounds: int) -> None:
    expected = sum(r.max_tokens for r in workload)
    for arm in arms:
        asyncio.run(stream_all(arm.cluster.address, warmup_workload()))
    for round_ in range(rounds):
        for arm in arms:
            cpu_before = cpu_seconds(arm.metrics_port)
            started = time.perf_counter()
            generated = asyncio.run(stream_all(arm.cluster.address, workload))
            seconds = time.perf_counter() - started
            arm.cpu.append(cpu_seconds(arm.metrics_port) - cpu_before)
            assert generated == expected, (generated, expected)
            arm.tps.append(generated / seconds)
            print(f"round {round_ + 1} {arm.name:12s}: {generated / seconds:8.1f} output tok/s "
                  f"({seconds:.2f} s, {arm.cpu[-1]:.2f} CPU s)", flush=True)


def report(base: Arm, other: Arm) -> None:
    """Medians and ratios (other / base)."""
    off, on = statistics.median(base.tps), statistics.median(other.tps)
    cpu_off, cpu_on = statistics.median(base.cpu), statistics.median(other.cpu)
    print(f"median output tok/s: {base.name} {off:.1f}, {other.name} {on:.1f}; "
          f"ratio {on / off:.3f} ({(1 - on / off) * 100:+.1f}% cost)")
    print(f"median CPU s per round: {base.name} {cpu_off:.2f}, {other.name} {cpu_on:.2f}; "
          f"ratio {cpu_on / cpu_off:.3f} ({(cpu_on / cpu_off - 1) * 100:+.1f}% cost)")
