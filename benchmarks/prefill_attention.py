"""The C++ CPU prefill-attention kernel against the torch path it replaced.

    .venv/bin/python benchmarks/prefill_attention.py [--threads 2] [--repeats 9]
        [--dtype bfloat16,float32]

For each batch, `paged_attention` of a batch of prompts as the engine calls it, once with
the C++ kernels (`paged_prefill` for the prompts) and once on the torch path (each prompt
gathered from the cache and run through SDPA, one call per prompt), alternating run by
run so a loaded machine slows both alike. Printed: each one's median time, its attention
GFLOP/s (4 * causal pairs * head_dim * heads) and the ratio torch/kernel; both outputs
must agree within the kernel tests' tolerance.

Batches (block size 16, blocks in shuffled order):
- pool32: 32 prompts of seeded random lengths 16-512 (benchmarks/pooling.py's inputs),
- one512: one 512-token prompt (a chat prompt's prefill),
- short8: eight 64-token prompts;
each at three head layouts: 6 heads over 2 kv heads at head size 64 (pooling.py's
embedder), 9 over 3 at 64 (SmolLM2-135M), 32 over 8 at 128 (Llama-3-8B).
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from pathlib import Path

# Runnable as a script from anywhere: the repository root is the import root.
ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "kernels")]

import torch  # noqa: E402
from corestream_kernels.backend import set_backend  # noqa: E402
from corestream_kernels.cpu_paged_attention import warm_up  # noqa: E402
from corestream_kernels.paged_attention import paged_attention  # noqa: E402

from tests.kernels.paged_batch import make_batch  # noqa: E402

LAYOUTS = ((6, 2, 64), (9, 3, 64), (32, 8, 128))  # (heads, kv heads, head size)
TOLERANCE = {torch.float32: 1e-4, torch.bfloat16: 3e-2}


def batches(seed: int) -> dict[str, list[tuple[int, int]]]:
    rng = random.Random(seed)
    return {
        "pool32": [(0, rng.randint(16, 512)) for _ in range(32)],
        "one512": [(0, 512)],
        "short8": [(0, 64)] * 8,
    }


def timed(args: tuple[object, ...]) -> tuple[float, torch.Tensor]:
    """(seconds, output) of one paged_attention call on the backend set now."""
    start = time.perf_counter()
    out = paged_attention(*args)
    return time.perf_counter() - start, out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=9)
    parser.add_argument("--dtype", default="bfloat16,float32")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    if warm_up() is None:
        sys.exit("the CPU extension did not build")
    print(f"threads {args.threads}, median of {args.repeats} runs each")
    for dtype_name in args.dtype.split(","):
        dtype = getattr(torch, dtype_name)
        for heads, kv_heads, head_dim in LAYOUTS:
            for name, shapes in batches(seed=0).items():
                b = make_batch(shapes, heads=heads, kv_heads=kv_heads, head_dim=head_dim,
                               block_size=16, dtype=dtype)
                flops = sum(4 * n * (n + 1) / 2 * head_dim * heads for _, n in shapes)
                times: dict[str, list[float]] = {"cpp": [], "torch": []}
                outputs = {}
                for _ in range(args.repeats + 1):  # the first of each is a warm-up
                    for backend in times:
                        set_backend(backend)
                        seconds, outputs[backend] = timed(b.args())
                        times[backend].append(seconds)
                tol = TOLERANCE[dtype]
                torch.testing.assert_close(outputs["cpp"].float(), outputs["torch"].float(),
                                           atol=tol, rtol=tol)
                cpp, ref = (statistics.median(times[k][1:]) for k in ("cpp", "torch"))
                print(f"{dtype_name:8} H{heads:>2}/{kv_heads} D{head_dim:<3} {name:6} "
                      f"{sum(n for _, n in shapes):5} tokens: kernel {cpp * 1e3:8.2f} ms "
                      f"{flops / cpp / 1e9:6.1f} GFLOP/s | torch {ref * 1e3:8.2f} ms "
                      f"{flops / ref / 1e9:6.1f} GFLOP/s | torch/kernel {ref / cpp:5.2f}x")
    set_backend("auto")


if __name__ == "__main__":
    main()
