"""Expert parallelism on CPU: one MoE layer in one process vs split over two gloo ranks.

    .venv/bin/python benchmarks/moe_ep.py [--hidden 1024 --experts 8 --tokens 1 16 128]

For each batch size T (tokens per rank), times one sparse MoE block (top-2, SwiGLU
experts, random weights):
  - single: one process with every expert, over 2T tokens (both ranks' batches as one
    engine would run them), with one thread and with all of torch's default threads;
  - 2 ranks: each rank holds half the experts and brings T tokens, one thread each,
    through the all-gather / local experts / all-reduce dispatch (services.engine.parallel);
  - comm only: the same dispatch with the experts skipped, i.e. its collectives and copies
    (three per layer here: token counts, tokens, outputs; a model exchanges the counts
    once per forward for all its layers).
Prints medians in milliseconds. Both sides compute the same result; what expert
parallelism buys is memory (each rank holds 1/N of the experts), and what it costs is
shown by the comm-only column.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "protos"), str(ROOT / "kernels")]

import torch  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402

from services.engine.models.decoder_config import DecoderConfig, MoEConfig  # noqa: E402
from services.engine.models.moe import SparseMoeBlock  # noqa: E402
from services.engine.parallel.dp_group import init_dp_group  # noqa: E402
from services.engine.parallel.expert_parallel import ExpertParallel  # noqa: E402

WORLD = 2


def make_config(args: argparse.Namespace) -> DecoderConfig:
    moe = MoEConfig(num_experts=args.experts, num_experts_per_tok=2,
                    intermediate_size=args.intermediate, sparse_layers=(0,),
                    norm_topk_prob=True)
    return DecoderConfig(vocab_size=16, hidden_size=args.hidden, intermediate_size=1,
                         num_hidden_layers=1, num_attention_heads=1, num_key_value_heads=1,
                         head_dim=args.hidden, max_position_embeddings=16, moe=moe)


def make_block(config: DecoderConfig, ep: ExpertParallel) -> SparseMoeBlock:
    """Random weights, the same on every rank: each rank keeps its slice of the experts."""
    block = SparseMoeBlock(config, ep)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        block.gate.weight.copy_(torch.randn(block.gate.weight.shape, generator=gen) * 0.05)
        for param in (block.experts.w13, block.experts.w2):
            full = torch.randn((config.moe.num_experts, *param.shape[1:]), generator=gen) * 0.02
            local = ep.local_experts(config.moe.num_experts)
            param.copy_(full[local.start : local.stop])
    return block.eval()


def median_ms(fn: Callable[[], object], repeats: int) -> float:
    for _ in range(3):
        fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def tokens(n: int, hidden: int, seed: int) -> torch.Tensor:
    return torch.randn(n, hidden, generator=torch.Generator().manual_seed(seed))


@torch.inference_mode()
def rank_main(rank: int, port: int, args: argparse.Namespace, single: dict[int, float]) -> None:
    torch.set_num_threads(1)
    group = init_dp_group(rank, WORLD, "127.0.0.1", port, timeout_s=120)
    ep = ExpertParallel(group)
    block = make_block(make_config(args), ep)
    if rank == 0:
        print(f"hidden {args.hidden}, {args.experts} experts of {args.intermediate}, top-2; "
              f"{torch.get_num_threads()} thread per rank")
        print(f"{'T/rank':>7} {'single 1 thr':>13} {'single all':>11} {'2 ranks':>8} "
              f"{'comm only':>10}   (ms)")
    for n in args.tokens:
        x = tokens(n, args.hidden, seed=rank)
        ep_ms = median_ms(lambda x=x: block(x), args.repeats)
        comm_ms = median_ms(lambda x=x: ep.dispatch(x, torch.zeros_like), args.repeats)
        if rank == 0:
            one, every = single[n]
            print(f"{n:>7} {one:>13.2f} {every:>11.2f} {ep_ms:>8.2f} {comm_ms:>10.2f}")


@torch.inference_mode()
def single_process(args: argparse.Namespace) -> dict[int, tuple[float, float]]:
    block = make_block(make_config(args), ExpertParallel(None))
    default_threads = torch.get_num_threads()
    out = {}
    for n in args.tokens:
        x = torch.cat([tokens(n, args.hidden, seed=r) for r in range(WORLD)])
        times = []
        for threads in (1, default_threads):
            torch.set_num_threads(threads)
            times.append(median_ms(lambda x=x: block(x), args.repeats))
        out[n] = (times[0], times[1])
    torch.set_num_threads(default_threads)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--intermediate", type=int, default=1024)
    parser.add_argument("--experts", type=int, default=8)
    parser.add_argument("--tokens", type=int, nargs="+", default=[1, 16, 128])
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--port", type=int, default=29517)
    args = parser.parse_args()
    single = single_process(args)
    mp.spawn(rank_main, args=(args.port, args, single), nprocs=WORLD, join=True)


if __name__ == "__main__":
    main()
