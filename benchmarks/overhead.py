"""Serving overhead alone: the throughput run with a model that returns fixed logits.

    .venv/bin/python benchmarks/overhead.py [--num-requests 256]

The model (services/engine/models/fixed_logits.py) costs nothing, so what remains is
the scheduler, the model runner's batch building and sampling, the busy loop, and,
through the cluster, gRPC and the frontend. Prints steps/s and tokens/s in process
and through the cluster at 256 concurrent requests, then a cProfile summary of the
engine steps (where the time goes).
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import sys
from pathlib import Path

# Runnable as a script from anywhere: the repository root is the import root.
ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "protos"), str(ROOT / "kernels")]

from benchmarks.throughput import Result, run_cluster, run_engine  # noqa: E402
from benchmarks.workload import BenchRequest, fixed_logits_checkpoint, mixed_workload  # noqa: E402


def profile_engine(model: Path, workload: list[BenchRequest], args: argparse.Namespace) -> str:
    """cProfile of the engine steps, run on this thread so the profiler sees them."""
    from services.common.sampling import SamplingParams
    from services.engine.config import EngineConfig
    from services.engine.core.engine_core import EngineCore
    from services.engine.request import Request
    from services.engine.worker.config import RunnerConfig
    from services.engine.worker.model_runner import ModelRunner

    runner = ModelRunner(RunnerConfig(model=str(model), kv_cache_memory=args.kv_cache_memory))
    runner.settle()
    core = EngineCore(EngineConfig(max_num_seqs=args.max_num_seqs,
                                   max_num_batched_tokens=args.max_num_batched_tokens), runner)
    for i, r in enumerate(workload):
        sampling = SamplingParams(temperature=0.0, max_tokens=r.max_tokens, ignore_eos=True)
        core.scheduler.add_request(Request(f"p{i}", list(r.prompt), sampling))
    profiler = cProfile.Profile()
    profiler.enable()
    while core.scheduler.has_work():
        core.step()
        while not core.output_queue.empty():
            core.output_queue.get_nowait()
    profiler.disable()
    out = io.StringIO()
    pstats.Stats(profiler, stream=out).sort_stats("tottime").print_stats(18)
    return out.getvalue()


def show(r: Result) -> None:
    print(f"{r.name:<34} {r.steps / r.seconds:>9.1f} steps/s {r.output_tps:>10.1f} output tok/s "
          f"{r.total_tps:>10.1f} total tok/s ({r.steps} steps in {r.seconds:.2f}s)", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--num-requests", type=int, default=256)
    parser.add_argument("--max-num-seqs", type=int, default=256)
    parser.add_argument("--max-num-batched-tokens", type=int, default=2048)
    parser.add_argument("--kv-cache-memory", default="512MiB")
    parser.add_argument("--device", default="auto", help="where the engine in process runs")
    parser.add_argument("--skip-cluster", action="store_true")
    args = parser.parse_args()

    model = fixed_logits_checkpoint()
    workload = mixed_workload(args.num_requests)
    print(f"fixed-logits model, {len(workload)} concurrent requests, "
          f"{sum(r.max_tokens for r in workload)} output tokens")
    show(run_engine(model, workload, args))
    if not args.skip_cluster:
        show(run_cluster(model, workload, args))
    print("\nwhere the engine's time goes (cProfile, in process, by own time):")
    print(profile_engine(model, workload, args))


if __name__ == "__main__":
    main()
