"""Linear weights packed for oneDNN at load against plain ones through F.linear (MKL).

    .venv/bin/python benchmarks/cpu_linear.py [--rounds 5] [--threads 2]

Two model runners on the benchmark checkpoint, one as the engine loads it (weights
packed: kernels/cpu_linear.py) and one as a torch without oneDNN would (plain weights,
float32 ones stored column-major), each step through `ModelRunner.execute` (no
scheduler, no gRPC): decode at batch 1, 16 and 128, and single prefills of 264 and 2048
tokens. Each round runs every workload on both runners back to back, so that a loaded
machine slows both alike; printed are each side's median step and the ratio
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
sys.path[:0] = [str(ROOT), str(ROOT / "protos")]

import torch  # noqa: E402

from benchmarks.decode_step import decode_times, prefill_times  # noqa: E402
from benchmarks.vllm_reference import cpu_line  # noqa: E402
from benchmarks.workload import bench_checkpoint  # noqa: E402
from services.engine.models import linear as linear_module  # noqa: E402
from services.engine.worker.config import RunnerConfig  # noqa: E402
from services.engine.worker.model_runner import ModelRunner  # noqa: E402

KINDS = ("packed", "plain")


def load(dtype: str, threads: int, packed: bool) -> ModelRunner:
    can_pack = linear_module.can_pack
    if not packed:
        linear_module.can_pack = lambda weight: False
    try:
        return ModelRunner(RunnerConfig(model=str(bench_checkpoint()), dtype=dtype,
                                        kv_cache_memory=1 << 30, max_model_len=2048,
                                        num_threads=threads))
    finally:
        linear_module.can_pack = can_pack


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=16, help="decode steps per round")
    parser.add_argument("--threads", type=int, default=0,
                        help="the runners' num_threads (0: one per usable CPU)")
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    args = parser.parse_args()
    runners = {kind: load(args.dtype, args.threads, kind == "packed") for kind in KINDS}
    workloads: dict[str, Callable[[ModelRunner, str], list[float]]] = {
        "decode1": lambda r, tag: decode_times(r, 1, 128, args.steps, tag),
        "decode16": lambda r, tag: decode_times(r, 16, 128, args.steps, tag),
        "decode128": lambda r, tag: decode_times(r, 128, 64, args.steps, tag),
        "prefill264": lambda r, tag: prefill_times(r, 264, tag),
        "prefill2048": lambda r, tag: prefill_times(r, 2048, tag),
    }
    samples: dict[tuple[str, str], list[float]] = {(w, k): [] for w in workloads for k in KINDS}
    for runner in runners.values():
        runner.warmup()
    for r in range(args.rounds):
        for w, run in workloads.items():
            for kind, runner in runners.items():
                samples[w, kind] += run(runner, f"{w}-{kind}-{r}-")
    print(f"{cpu_line()}\n{args.dtype}, threads {torch.get_num_threads()}, {args.rounds} rounds")
    for w in workloads:
        packed, plain = (statistics.median(samples[w, k]) * 1000 for k in KINDS)
        print(f"{w:12s} packed {packed:8.2f} ms  plain {plain:8.2f} ms  "
              f"packed/plain {packed / plain:.3f}")


if __name__ == "__main__":
    main()
