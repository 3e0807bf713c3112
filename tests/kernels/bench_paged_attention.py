"""CPU timing of `paged_attention` on serving-sized batches (not collected by pytest).

Run: .venv/bin/python -m tests.kernels.bench_paged_attention
"""

from __future__ import annotations

import time

import torch

from kernels.paged_attention import paged_attention

HEADS, KV_HEADS, DIM, BLOCK_SIZE = 8, 4, 64, 16


def _time_batch(shapes: list[tuple[int, int]], repeats: int) -> float:
    """Best milliseconds per call for sequences given as (cached prefix, new tokens)."""
    gen = torch.Generator().manual_seed(0)
    blocks_per_seq = [-(-(p + n) // BLOCK_SIZE) for p, n in shapes]
    num_blocks = sum(blocks_per_seq) + 1
    key_cache = torch.randn(num_blocks, BLOCK_SIZE, KV_HEADS, DIM, generator=gen)
    value_cache = torch.randn(num_blocks, BLOCK_SIZE, KV_HEADS, DIM, generator=gen)
    # Shuffled blocks, as after some churn in the block manager.
    order = (torch.randperm(num_blocks - 1, generator=gen) + 1).tolist()
    width = max(blocks_per_seq)
    tables, starts, seq_lens = [], [0], []
    for (prefix, new), n in zip(shapes, blocks_per_seq, strict=True):
        tables.append([order.pop() for _ in range(n)] + [0] * (width - n))
        starts.append(starts[-1] + new)
        seq_lens.append(prefix + new)
    query = torch.randn(starts[-1], HEADS, DIM, generator=gen)
    args = (
        query,
        key_cache,
        value_cache,
        torch.tensor(tables, dtype=torch.int32),
        torch.tensor(seq_lens, dtype=torch.int32),
        starts,
        seq_lens,
        DIM**-0.5,
    )
    paged_attention(*args)
    # The best of several runs: the machine is shared, so the mean mostly measures neighbours.
    best = float("inf")
    for _ in range(repeats):
        begin = time.perf_counter()
        paged_attention(*args)
        best = min(best, time.perf_counter() - begin)
    return best * 1e3


def main() -> None:
    torch.manual_seed(0)
    cases = {
        "decode   B=128 ctx=300": [(299, 1)] * 128,
        "decode   B=256 ctx=800": [(799, 1)] * 256,
        "decode   B=32 ctx 50..800": [(50 + 24 * i, 1) for i in range(32)],
        "prefill  B=32 x 64 new, no prefix": [(0, 64)] * 32,
        "chunks   B=32 x 32 new after 256": [(256, 32)] * 32,
        "mixed    4 x 128 prompt + 124 decodes ctx 300": [(0, 128)] * 4 + [(299, 1)] * 124,
    }
    print(f"threads={torch.get_num_threads()} heads={HEADS} kv_heads={KV_HEADS} dim={DIM} fp32")
    for name, shapes in cases.items():
        print(f"{name:48s} {_time_batch(shapes, repeats=10):8.2f} ms/call")


if __name__ == "__main__":
    main()
