"""CPU timing of `paged_attention` on serving-sized batches, torch path vs C++ decode kernel.

Run: .venv/bin/python -m tests.kernels.bench_paged_attention  (not collected by pytest)

Prompts and chunks take the torch path under both columns; only decodes differ.
"""

from __future__ import annotations

import statistics
import time

import torch
from corestream_kernels.backend import set_backend
from corestream_kernels.cpu_paged_attention import warm_up
from corestream_kernels.paged_attention import paged_attention

HEADS, KV_HEADS, DIM, BLOCK_SIZE = 8, 4, 64, 16
BACKENDS = ("torch", "cpp")


def _time_batch(
    shapes: list[tuple[int, int]], repeats: int, window: int | None = None
) -> dict[str, float]:
    """Median milliseconds per call for each backend, for sequences given as
    (cached prefix, new tokens), attending through a sliding `window` if one is given."""
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
        torch.tensor(starts, dtype=torch.int32),
        starts,
        seq_lens,
        DIM**-0.5,
        window,
    )
    # Backends alternate call by call, so that load from neighbours on a shared machine
    # falls on both alike; the median then resists their spikes.
    times: dict[str, list[float]] = {name: [] for name in BACKENDS}
    for _ in range(repeats + 1):
        for name in BACKENDS:
            set_backend(name)
            begin = time.perf_counter()
            paged_attention(*args)
            times[name].append(time.perf_counter() - begin)
    set_backend("auto")
    return {name: statistics.median(t[1:]) * 1e3 for name, t in times.items()}


def main() -> None:
    torch.manual_seed(0)
    set_backend("cpp")
    warm_up()
    cases = {
        "decode   B=1 ctx=256": [(255, 1)],
        "decode   B=128 ctx=300": [(299, 1)] * 128,
        "decode   B=128 ctx=800": [(799, 1)] * 128,
        "decode   B=256 ctx=800": [(799, 1)] * 256,
        "decode   B=32 ctx 50..800": [(50 + 24 * i, 1) for i in range(32)],
        "prefill  B=32 x 64 new, no prefix": [(0, 64)] * 32,
        "chunks   B=32 x 32 new after 256": [(256, 32)] * 32,
        "mixed    4 x 128 prompt + 124 decodes ctx 300": [(0, 128)] * 4 + [(299, 1)] * 124,
        "decode   B=64 ctx=2048": [(2047, 1)] * 64,
        "decode   B=64 ctx=2048 window=256": ([(2047, 1)] * 64, 256),
        "chunks   B=8 x 128 new after 1920 window=256": ([(1920, 128)] * 8, 256),
    }
    print(f"threads={torch.get_num_threads()} heads={HEADS} kv_heads={KV_HEADS} dim={DIM} fp32")
    print(f"{'median ms/call':48s} {'torch':>8s} {'C++':>8s}")
    for name, case in cases.items():
        shapes, window = case if isinstance(case, tuple) else (case, None)
        repeats = 200 if len(shapes) == 1 else 20
        ms = _time_batch(shapes, repeats, window)
        print(f"{name:48s} {ms['torch']:8.3f} {ms['cpp']:8.3f}   x{ms['torch'] / ms['cpp']:.2f}")


if __name__ == "__main__":
    main()
