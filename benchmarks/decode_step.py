"""The model runner's step in process: the C++ CPU kernels against the torch path.

    .venv/bin/python benchmarks/decode_step.py [--rounds 5] [--threads 2] [--model PATH]

On the benchmark checkpoint (or `--model`: any checkpoint `corestream serve --model`
takes, e.g. a GGUF file), through `ModelRunner.execute` (no scheduler, no gRPC):
- decode, batch 1: one sequence after a 128-token prompt, one token per step (latency);
- decode, batch 128: 128 sequences after 64-token prompts, one token each per step;
- prefill: one chunk of 2048 prompt tokens;
- or any others by `--workloads`: decode<N> (N sequences), prefill<N> (N tokens).
Each round runs every workload on both backends (`corestream_kernels.backend`: "cpp", then
"torch") back to back, so that a loaded machine slows both alike; the script prints
each side's median step and the ratio cpp/torch (`--backends cpp` times the C++ side
alone: on a GGUF model the torch path dequantizes every weight at every step), and where
the C++ step ran as one StagePlan, the time its threads spent waiting at stage ends for
each other's items (mean per step, summed over threads). Prefills of the decode
workloads are not timed.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

# Runnable as a script from anywhere: the repository root is the import root.
ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "protos"), str(ROOT / "kernels")]

import torch  # noqa: E402
from corestream_kernels.backend import set_backend  # noqa: E402

from benchmarks.sequences import Sequences  # noqa: E402
from benchmarks.workload import VOCAB, bench_checkpoint  # noqa: E402
from services.common.tiny_checkpoint import resolve_model  # noqa: E402
from services.engine.worker.config import RunnerConfig  # noqa: E402
from services.engine.worker.heap import keep_freed_memory  # noqa: E402
from services.engine.worker.model_runner import ModelRunner  # noqa: E402

BACKENDS = ("cpp", "torch")


def plan_counters() -> list[int]:
    """The C++ decode step's StagePlan counters (work_items.h), zeros before it is built."""
    ops = torch.ops.corestream_cpu
    return list(ops.stage_plan_counters()) if hasattr(ops, "stage_plan_counters") else [0] * 5


def random_prompts(num_seqs: int, prompt_len: int, vocab: int = VOCAB) -> list[list[int]]:
    gen = torch.Generator().manual_seed(0)
    return [torch.randint(3, vocab, (prompt_len,), generator=gen).tolist()
            for _ in range(num_seqs)]


def decode_times(runner: ModelRunner, num_seqs: int, prompt_len: int, steps: int,
                 tag: str) -> list[float]:
    prompts = random_prompts(num_seqs, prompt_len, runner.model_info.vocab_size)
    seqs = Sequences(runner, prompts, prompt_len + steps + 1, tag)
    seqs.prefill()
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        seqs.decode()
        times.append(time.perf_counter() - start)
    seqs.finish()
    return times


def prefill_times(runner: ModelRunner, tokens: int, tag: str) -> list[float]:
    seqs = Sequences(runner, random_prompts(1, tokens, runner.model_info.vocab_size), tokens,
                     tag)
    start = time.perf_counter()
    seqs.prefill()
    elapsed = time.perf_counter() - start
    seqs.finish()
    return [elapsed]


def workload(runner: ModelRunner, name: str, steps: int) -> Callable[[str], list[float]]:
    """decode<N>: N sequences (after 128-token prompts for one, 64 for more), one token
    each per step; prefill<N>: one chunk of N prompt tokens."""
    kind = name.rstrip("0123456789")
    count = int(name[len(kind):] or 0)
    if kind == "decode" and count > 0:
        prompt = 128 if count == 1 else 64
        return lambda tag: decode_times(runner, count, prompt, steps, tag)
    if kind == "prefill" and count > 0:
        return lambda tag: prefill_times(runner, count, tag)
    raise SystemExit(f"unknown workload {name!r}: decode<N> or prefill<N>")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=32, help="decode steps per round")
    parser.add_argument("--threads", type=int, default=0,
                        help="the runner's num_threads (0: one per usable CPU)")
    parser.add_argument("--workloads", default="decode1,decode128,prefill2048",
                        help="decode<N> (N sequences), prefill<N> (N tokens), comma-separated")
    parser.add_argument("--model", default="",
                        help="a checkpoint folder or GGUF file (default: the benchmark's)")
    parser.add_argument("--dtype", default="auto",
                        help="the runner's dtype (auto: the checkpoint's; float32 for GGUF)")
    parser.add_argument("--kv-cache-dtype", default="auto",
                        help="the runner's KV cache dtype (auto: the model's)")
    parser.add_argument("--backends", default=",".join(BACKENDS),
                        help="the first is the numerator of the ratio")
    args = parser.parse_args()
    model = resolve_model(args.model) if args.model else bench_checkpoint()
    backends = args.backends.split(",")
    runner = ModelRunner(RunnerConfig(model=str(model), dtype=args.dtype,
                                      kv_cache_dtype=args.kv_cache_dtype, kv_cache_memory=1 << 30,
                                      max_model_len=2048, num_threads=args.threads))
    chosen = args.workloads.split(",")
    workloads = {w: workload(runner, w, args.steps) for w in chosen}
    samples = {(w, b): [] for w in chosen for b in backends}
    waits = {w: [0, 0] for w in chosen}  # [plans run, ns waited] on the cpp side
    for backend in backends:  # builds the kernels and warms both paths up
        set_backend(backend)
        runner.warmup()
        runner.settle()
    keep_freed_memory()  # as the engine process does once warm
    for r in range(args.rounds):
        for w in chosen:
            for backend in backends:
                set_backend(backend)
                before = plan_counters()
                samples[w, backend] += workloads[w](f"{w}-{backend}-{r}-")
                if backend == "cpp":
                    after = plan_counters()
                    waits[w][0] += after[0] - before[0]
                    waits[w][1] += after[4] - before[4]
    print(f"{model.name}: threads {torch.get_num_threads()}, {args.rounds} rounds")
    for w in chosen:
        medians = [statistics.median(samples[w, b]) * 1000 for b in backends]
        sides = "  ".join(f"{b} {ms:8.2f} ms" for b, ms in zip(backends, medians, strict=True))
        ratio = (f"  {backends[0]}/{backends[1]} {medians[0] / medians[1]:.3f}"
                 if len(backends) > 1 else "")
        plans, waited_ns = waits[w]
        wait = (f"  stage-end waits {waited_ns / plans / 1000:.0f} us a step (all threads)"
                if plans else "")
        print(f"{w:12s} {sides}{ratio}{wait}")


if __name__ == "__main__":
    main()
