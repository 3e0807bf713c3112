"""Builds `paged_decode` and `paged_prefill` with extra compiler flags and checks them
against the dense reference.

    python -m tests.kernels.cpu_variant_check -march=x86-64-v3

The CPU extension is built for the machine it runs on, so on an AVX-512 machine the tests
never reach the code other machines run: the portable loops (no AVX-512) or the AVX-512
code without bf16 dot products. Flags such as `-march=x86-64-v3` or `-mno-avx512bf16`
build those into a separate extension. Its op registers under the same name as the
real extension's, so this runs in a process of its own (see test_cpu_paged_attention).
"""

from __future__ import annotations

import hashlib
import itertools
import sys
from pathlib import Path

import torch
from torch.utils import cpp_extension

from tests.kernels.paged_batch import make_batch

CSRC = Path(__file__).resolve().parents[2] / "kernels" / "corestream_kernels" / "csrc"
LENGTHS = [15, 16, 17, 1, 31, 33, 50, 7, 100, 47]
PREFILLS = [(0, 15), (0, 33), (20, 17), (3, 70), (0, 2)]
# (query, cache) dtypes: alike, and --kv-cache-dtype's float16 under float32.
DTYPES = [(torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16),
          (torch.float32, torch.float16)]


def main(flags: list[str]) -> None:
    digest = hashlib.sha256(" ".join(flags).encode())
    for path in sorted(CSRC.glob("*.[ch]*")):
        digest.update(path.read_bytes())
    cpp_extension.load(
        name=f"corestream_decode_variant_{digest.hexdigest()[:12]}",
        sources=[str(CSRC / "paged_attention_cpu.cpp"), str(CSRC / "paged_prefill_cpu.cpp")],
        extra_cflags=["-O3", "-march=native", "-fopenmp", *flags],
        extra_ldflags=["-fopenmp"],
        is_python_module=False,
    )
    kernel = torch.ops.corestream_cpu.paged_decode
    torch.set_num_threads(2)
    cases = itertools.product(
        DTYPES, [24, 64, 80, 128], [8, 2, 1], [1, 16], [0, 9], [3, 10]
    )
    for (dtype, cache_dtype), head_dim, kv_heads, block_size, window, num_seqs in cases:
        b = make_batch([(n - 1, 1) for n in LENGTHS[:num_seqs]], heads=8, kv_heads=kv_heads,
                       head_dim=head_dim, block_size=block_size, dtype=dtype,
                       fill=float("nan"), sliding_window=window or None,
                       cache_dtype=cache_dtype)
        out = torch.empty_like(b.query)
        kernel(out, b.query, b.key_cache, b.value_cache, b.block_tables, b.seq_lens, b.scale,
               window)
        tol = 1e-5 if dtype == torch.float32 else 3e-2
        torch.testing.assert_close(out.float(), b.reference, atol=tol, rtol=tol)
    prefill = torch.ops.corestream_cpu.paged_prefill
    cases = itertools.product(DTYPES, [24, 64, 128], [8, 2, 1], [1, 16], [0, 9])
    for (dtype, cache_dtype), head_dim, kv_heads, block_size, window in cases:
        # Whole prompts and chunks after a prefix, across the kernel's key tiles.
        b = make_batch(PREFILLS, heads=8, kv_heads=kv_heads, head_dim=head_dim,
                       block_size=block_size, dtype=dtype, fill=float("nan"),
                       sliding_window=window or None, cache_dtype=cache_dtype)
        out = torch.empty_like(b.query)
        prefill(out, b.query, b.key_cache, b.value_cache, b.block_tables, b.seq_lens,
                b.query_start_loc, b.scale, window)
        tol = 1e-5 if dtype == torch.float32 else 3e-2
        torch.testing.assert_close(out.float(), b.reference, atol=tol, rtol=tol)


if __name__ == "__main__":
    main(sys.argv[1:])
