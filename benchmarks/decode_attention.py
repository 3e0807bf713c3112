"""The C++ CPU decode-attention kernel against an earlier version of itself.

    .venv/bin/python benchmarks/decode_attention.py [--threads 2] [--repeats 20]
        [--baseline REV] [--dtype float32|bfloat16]

`paged_decode` of this working tree (the extension `corestream_kernels.cpu_extension` builds) and
the same op as of git revision REV (default: the last version before the AVX-512 tiles),
built from `git show REV:kernels/csrc/...` into a separate extension whose op namespace
is renamed, so both live in one process. For each shape both kernels run on the same
tensors in alternation, so a loaded machine slows both alike; the script prints each
one's median time, its K+V read throughput (bytes of K and V read / time) and the ratio
old/new. Both outputs must agree within the kernel tests' tolerance.

Shapes: 8 query heads, 4 kv heads, head_dim 64, block size 16, blocks picked at random
from a 4096-block cache (as after churn in the block manager); batch 4 and 16 mostly
stay in cache, batch 120 at 400 tokens (98 MB in fp32) is read from DRAM.
"""

from __future__ import annotations

import argparse
import hashlib
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

# Runnable as a script from anywhere: the repository root is the import root.
ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "kernels")]

import torch  # noqa: E402
from corestream_kernels.cpu_paged_attention import DecodeFn, warm_up  # noqa: E402

# The kernel before the AVX-512 tiles: one horizontal sum per (token, query head).
DEFAULT_BASELINE = "d60f15aecdf17218e88a39dfb7b13e65ae6d48ae"
# Where the sources were at the baseline (kernels/ held them before it held a package).
SOURCES = ("kernels/csrc/paged_attention_cpu.cpp", "kernels/csrc/cpu_math.h")
HEADS, KV_HEADS, HEAD_DIM, BLOCK_SIZE, CACHE_BLOCKS = 8, 4, 64, 16, 4096
SHAPES = ((4, 256), (16, 384), (120, 400))  # (batch, tokens of context per sequence)
TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 3e-2}


def build_baseline(rev: str) -> DecodeFn:
    """`paged_decode` as of `rev`, as op corestream_cpu_baseline::paged_decode."""
    from torch.utils import cpp_extension

    texts = {}
    for source in SOURCES:
        texts[Path(source).name] = subprocess.run(
            ["git", "-C", str(ROOT), "show", f"{rev}:{source}"],
            check=True, capture_output=True, text=True,
        ).stdout
    main = Path(SOURCES[0]).name
    for macro in ("TORCH_LIBRARY(", "TORCH_LIBRARY_IMPL("):
        renamed = texts[main].replace(f"{macro}corestream_cpu,", f"{macro}corestream_cpu_baseline,")
        if renamed == texts[main]:
            raise SystemExit(f"{rev}:{SOURCES[0]} has no {macro}corestream_cpu, ...)")
        texts[main] = renamed
    digest = hashlib.sha256("".join(texts.values()).encode()).hexdigest()[:12]
    with tempfile.TemporaryDirectory() as tmp:
        for name, text in texts.items():
            (Path(tmp) / name).write_text(text)
        cpp_extension.load(
            name=f"corestream_decode_baseline_{digest}",
            sources=[str(Path(tmp) / main)],
            extra_cflags=["-O3", "-march=native", "-fopenmp"],
            extra_ldflags=["-fopenmp"],
            is_python_module=False,
        )
    return torch.ops.corestream_cpu_baseline.paged_decode


def make_inputs(batch: int, tokens: int, dtype: torch.dtype, gen: torch.Generator) -> tuple:
    shape = (CACHE_BLOCKS, BLOCK_SIZE, KV_HEADS, HEAD_DIM)
    key_cache = torch.randn(shape, generator=gen).to(dtype)
    value_cache = torch.randn(shape, generator=gen).to(dtype)
    per_seq = -(-tokens // BLOCK_SIZE)
    tables = torch.randperm(CACHE_BLOCKS, generator=gen)[: batch * per_seq]
    tables = tables.view(batch, per_seq).to(torch.int32).contiguous()
    query = torch.randn(batch, HEADS, HEAD_DIM, generator=gen).to(dtype)
    seq_lens = torch.full((batch,), tokens, dtype=torch.int32)
    return query, key_cache, value_cache, tables, seq_lens, HEAD_DIM**-0.5, 0


def time_pair(kernels: dict[str, DecodeFn], args: tuple, repeats: int) -> dict[str, float]:
    """Median seconds per call of each kernel, calls alternating between them."""
    outs = {name: torch.empty_like(args[0]) for name in kernels}
    for name, kernel in kernels.items():
        for _ in range(3):
            kernel(outs[name], *args)
    times: dict[str, list[float]] = {name: [] for name in kernels}
    for _ in range(repeats):
        for name, kernel in kernels.items():
            start = time.perf_counter()
            kernel(outs[name], *args)
            times[name].append(time.perf_counter() - start)
    old, new = outs["old"].float(), outs["new"].float()
    tol = TOLERANCE[args[0].dtype]
    torch.testing.assert_close(new, old, atol=tol, rtol=tol)
    return {name: statistics.median(ts) for name, ts in times.items()}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--baseline", default=DEFAULT_BASELINE,
                        help="git revision of the old kernel")
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    opts = parser.parse_args(argv)
    torch.set_num_threads(opts.threads)
    dtype = getattr(torch, opts.dtype)
    new = warm_up()
    if new is None:
        raise SystemExit("the CPU extension did not build")
    kernels: dict[str, Any] = {"old": build_baseline(opts.baseline), "new": new}
    gen = torch.Generator().manual_seed(0)
    print(f"{opts.threads} threads, {opts.dtype}, H={HEADS} Hkv={KV_HEADS} D={HEAD_DIM} "
          f"block={BLOCK_SIZE}; old = {opts.baseline[:10]}, new = working tree")
    print(f"{'shape':>14} {'K+V MB':>7} {'old ms':>8} {'old GB/s':>9} {'new ms':>8} "
          f"{'new GB/s':>9} {'old/new':>8}")
    for batch, tokens in SHAPES:
        args = make_inputs(batch, tokens, dtype, gen)
        medians = time_pair(kernels, args, opts.repeats)
        read = 2 * batch * tokens * KV_HEADS * HEAD_DIM * args[0].element_size()
        print(f"{f'B={batch} L={tokens}':>14} {read / 1e6:7.1f} "
              f"{medians['old'] * 1e3:8.3f} {read / medians['old'] / 1e9:9.1f} "
              f"{medians['new'] * 1e3:8.3f} {read / medians['new'] / 1e9:9.1f} "
              f"{medians['old'] / medians['new']:8.2f}")


if __name__ == "__main__":
    main()
