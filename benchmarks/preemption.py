"""A single-stream decode step beside other work on the same cores: one parallel region per
step (a StagePlan, `kernels/corestream_kernels/csrc/work_items.h`) against a fork and join per op.

    .venv/bin/python benchmarks/preemption.py [--rounds 10] [--bursts 3] [--burst-ms 0.5]

Through the cluster, the serving threads (the engine's gRPC threads, the frontend, the
client) take 1-1.5 ms of CPU per token on the cores the step runs on. This stands a
process in for them that, every 5 ms, burns `--bursts` bursts of `--burst-ms` with
`--gap-ms` of sleep between them, and times the benchmark checkpoint's decode step
(`--batch` sequences after 128-token prompts, `ModelRunner.execute`) with StagePlans on and off,
alternating, the same number of steps each; then the same without the burner. It prints
each side's median step and the ratio plan/regions per round.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time
from pathlib import Path

# Runnable as a script from anywhere: the repository root is the import root.
ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "protos"), str(ROOT / "kernels")]

from corestream_kernels.cpu_extension import load  # noqa: E402

from benchmarks.decode_step import decode_times  # noqa: E402
from benchmarks.workload import bench_checkpoint  # noqa: E402
from services.engine.worker.config import RunnerConfig  # noqa: E402
from services.engine.worker.model_runner import ModelRunner  # noqa: E402

BURNER = """
import sys, time
period, bursts, burn, gap = 0.005, int(sys.argv[1]), float(sys.argv[2]), float(sys.argv[3])
deadline = time.perf_counter()
while True:
    deadline += period
    for i in range(bursts):
        start = time.perf_counter()
        while time.perf_counter() - start < burn:
            pass
        if i < bursts - 1:
            time.sleep(gap)
    time.sleep(max(0.0, deadline - time.perf_counter()))
"""


def compare(runner: ModelRunner, ops: object, batch: int, rounds: int, steps: int, tag: str
            ) -> dict[str, list[float]]:
    medians: dict[str, list[float]] = {"regions": [], "plan": []}
    for r in range(rounds):
        for side in medians:
            ops.set_stage_plans_enabled(side == "plan")  # type: ignore[attr-defined]
            times = decode_times(runner, batch, 128, steps, f"{tag}-{side}-{r}-")
            medians[side].append(statistics.median(times) * 1000)
    ops.set_stage_plans_enabled(True)  # type: ignore[attr-defined]
    return medians


def report(title: str, medians: dict[str, list[float]]) -> None:
    regions, plan = medians["regions"], medians["plan"]
    ratios = [p / r for p, r in zip(plan, regions, strict=True)]
    print(f"{title}: regions {statistics.median(regions):.2f} ms, plan "
          f"{statistics.median(plan):.2f} ms; plan/regions per round: median "
          f"{statistics.median(ratios):.3f} (min {min(ratios):.3f}, max {max(ratios):.3f})")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--steps", type=int, default=64, help="decode steps per side and round")
    parser.add_argument("--bursts", type=int, default=3, help="bursts per 5 ms")
    parser.add_argument("--burst-ms", type=float, default=0.5)
    parser.add_argument("--gap-ms", type=float, default=0.5)
    parser.add_argument("--batch", type=int, default=1,
                        help="sequences per step (plans apply up to 8 in float32, 16 in bfloat16)")
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    args = parser.parse_args()
    runner = ModelRunner(RunnerConfig(model=str(bench_checkpoint()), kv_cache_memory=1 << 30,
                                      max_model_len=2048, dtype=args.dtype))
    runner.warmup()
    runner.settle()
    ops = load()
    if ops is None:
        sys.exit("the CPU kernels did not build: nothing to compare")
    burner = subprocess.Popen([sys.executable, "-c", BURNER, str(args.bursts),
                               str(args.burst_ms / 1000), str(args.gap_ms / 1000)])
    try:
        time.sleep(0.3)
        beside = compare(runner, ops, args.batch, args.rounds, args.steps, "burner")
    finally:
        burner.kill()
        burner.wait()
    alone = compare(runner, ops, args.batch, args.rounds, args.steps, "alone")
    print(f"decode step, batch {args.batch}, {args.dtype}, {args.rounds} rounds of {args.steps} "
          "steps per side")
    report(f"beside {args.bursts} x {args.burst_ms} ms per 5 ms", beside)
    report("alone", alone)


if __name__ == "__main__":
    main()
