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

import sys
from pathlib import Path

# Runnable as a script from anywhere: the repository root is the import root.
ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "protos"), str(ROOT / "kernels")]

from benchmarks.side_by_side import parse_args, report, run_rounds, start  # noqa: E402
from benchmarks.workload import bench_checkpoint, mixed_workload  # noqa: E402
from tests.integration.otlp_collector import OtlpCollector  # noqa: E402


def main() -> None:
    args = parse_args(__doc__.split("\n\n")[0])

    model = bench_checkpoint()
    workload = mixed_workload(args.num_requests)
    collector = OtlpCollector().start()
    arms = [start("tracing off", model, args.max_num_seqs, args.kv_cache_memory),
            start("tracing 1.0", model, args.max_num_seqs, args.kv_cache_memory,
                  ["--otlp-endpoint", collector.endpoint, "--trace-sample-ratio", "1.0"])]
    try:
        run_rounds(arms, workload, args.rounds)
    finally:
        for arm in arms:
            arm.cluster.stop()
        collector.stop()
    engine_spans = sum(s.name == "engine.request" for s in collector.spans)
    print(f"\n{args.num_requests} requests x {args.rounds} rounds, "
          f"{sum(r.max_tokens for r in workload)} output tokens each")
    report(*arms)
    print(f"spans received: {len(collector.spans)} ({engine_spans} engine request spans)")


if __name__ == "__main__":
    main()
