"""The CPU layouts of the linear weights, step against step
(kernels/corestream_kernels/cpu_linear.py).

    .venv/bin/python benchmarks/cpu_linear.py [--rounds 5] [--threads 2] [--dtype D]

Three model runners on the benchmark checkpoint: "panels" as the engine loads it
(weights packed for oneDNN, and the few-row kernel on the same bytes), "packed" (oneDNN
at every row count) and "plain", as a torch without oneDNN would (F.linear, float32
weights stored column-major). Each steps through `ModelRunner.execute` (no scheduler, no
gRPC): decode at batch 1, 4, 8, 16 and 128, and single prefills of 264 and 2048 tokens.
Each round runs every workload on every runner back to back, so that a loaded machine
slows all alike; printed are each one's median step and the ratios panels/packed and
packed/plain, with the CPU it ran on.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from collections.abc import Callable
from pathlib import Path

# Runnable as a script from anywhere: the repository root is the import root.
ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "protos"), str(ROOT / "kernels")]

import torch  # noqa: E402
from corestream_kernels import cpu_linear  # noqa: E402

from benchmarks.decode_step import decode_times, prefill_times  # noqa: E402
from benchmarks.vllm_reference import cpu_line  # noqa: E402
from benchmarks.workload import bench_checkpoint  # noqa: E402
from services.engine.worker.config import RunnerConfig  # noqa: E402
from services.engine.worker.model_runner import ModelRunner  # noqa: E402

KINDS = ("panels", "packed", "plain")


def load(dtype: str, threads: int, kind: str) -> ModelRunner:
    can_pack, weight_panels = cpu_linear.can_pack, cpu_linear.weight_panels
    own_panels = cpu_linear.own_panels
    if kind == "plain":
        cpu_linear.can_pack = lambda weight: False
    if kind != "panels":
        cpu_linear.weight_panels = lambda weight, packed: None
        cpu_linear.own_panels = lambda weight: None
    try:
        return ModelRunner(RunnerConfig(model=str(bench_checkpoint()), dtype=dtype,
                                        kv_cache_memory=1 << 30, max_model_len=2048,
                                        num_threads=threads))
    finally:
        cpu_linear.can_pack, cpu_linear.weight_panels = can_pack, weight_panels
        cpu_linear.own_panels = own_panels


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=16, help="decode steps per round")
    parser.add_argument("--threads", type=int, default=0,
                        help="the runners' num_threads (0: one per usable CPU)")
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    args = parser.parse_args()
    runners = {kind: load(args.dtype, args.threads, kind) for kind in KINDS}
    workloads: dict[str, Callable[[ModelRunner, str], list[float]]] = {
        "decode1": lambda r, tag: decode_times(r, 1, 128, args.steps, tag),
        "decode4": lambda r, tag: decode_times(r, 4, 128, args.steps, tag),
        "decode8": lambda r, tag: decode_times(r, 8, 128, args.steps, tag),
        "decode16": lambda r, tag: decode_times(r, 16, 128, args.steps, tag),
        "decode128": lambda r, tag: decode_times(r, 128, 64, args.steps, tag),
        "prefill264": lambda r, tag: prefill_times(r, 264, tag),
        "prefill2048": lambda r, tag: prefill_times(r, 2048, tag),
    }
    samples: dict[tuple[str, str], list[float]] = {(w, k): [] for w in workloads for k in KINDS}
    for runner in runners.values():
        runner.warmup()
        runner.settle()
    for r in range(args.rounds):
        for w, run in workloads.items():
            for kind, runner in runners.items():
                samples[w, kind] += run(runner, f"{w}-{kind}-{r}-")
    print(f"{cpu_line()}\n{args.dtype}, threads {torch.get_num_threads()}, {args.rounds} rounds")
    for w in workloads:
        panels, packed, plain = (statistics.median(samples[w, k]) * 1000 for k in KINDS)
        print(f"{w:12s} panels {panels:8.2f} ms  packed {packed:8.2f} ms  "
              f"plain {plain:8.2f} ms  panels/packed {panels / packed:.3f}  "
              f"packed/plain {packed / plain:.3f}")


if __name__ == "__main__":
    main()
