"""The C++ CPU decode kernel against the dense reference, and its fallback to torch."""

from __future__ import annotations

import logging
import platform
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import corestream_kernels.cpu_extension as cpu_extension
import corestream_kernels.cpu_paged_attention as cpu_module
import pytest
import torch
from corestream_kernels.backend import set_backend
from corestream_kernels.cpu_paged_attention import DecodeFn
from corestream_kernels.paged_attention import paged_attention

from tests.kernels.paged_batch import PagedBatch, make_batch

TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 3e-2}

# Lengths around block edges (1, block_size, block_size + 1 for both block sizes) and
# long enough for the running max to move several times.
LENGTHS = [1, 4, 5, 16, 17, 3, 40, 63, 2, 29, 8, 33]


@pytest.fixture
def threads() -> Iterator[None]:
    previous = torch.get_num_threads()
    yield
    torch.set_num_threads(previous)


def decode_batch(
    lengths: list[int], heads: int, kv_heads: int, head_dim: int, block_size: int,
    dtype: torch.dtype = torch.float32, fill: float = 0.0, sliding_window: int | None = None,
    cache_dtype: torch.dtype | None = None,
) -> PagedBatch:
    shapes = [(n - 1, 1) for n in lengths]
    return make_batch(shapes, heads=heads, kv_heads=kv_heads, head_dim=head_dim,
                      block_size=block_size, dtype=dtype, fill=fill,
                      sliding_window=sliding_window, cache_dtype=cache_dtype)


def run_kernel(kernel: DecodeFn, b: PagedBatch) -> torch.Tensor:
    out = torch.empty_like(b.query)
    kernel(out, b.query, b.key_cache, b.value_cache, b.block_tables, b.seq_lens, b.scale,
           b.sliding_window or 0)
    return out


def call(b: PagedBatch) -> torch.Tensor:
    return paged_attention(*b.args())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("head_dim", [24, 64, 128])
@pytest.mark.parametrize("block_size", [4, 16])
@pytest.mark.parametrize(("heads", "kv_heads"), [(4, 4), (4, 2), (8, 2)])
@pytest.mark.parametrize("num_seqs", [3, 12])
def test_matches_dense_reference(
    cpu_kernel: DecodeFn, threads: None, num_seqs: int, heads: int, kv_heads: int,
    block_size: int, head_dim: int, dtype: torch.dtype,
) -> None:
    # Two threads: 3 sequences split into one item per kv head, 12 run whole.
    torch.set_num_threads(2)
    b = decode_batch(LENGTHS[:num_seqs], heads, kv_heads, head_dim, block_size, dtype)
    out = run_kernel(cpu_kernel, b)
    assert out.dtype == dtype
    tol = TOLERANCE[dtype]
    torch.testing.assert_close(out.float(), b.reference, atol=tol, rtol=tol)


def test_unread_slots_do_not_leak(cpu_kernel: DecodeFn) -> None:
    # Padding table entries point at block 0 and the tails of last blocks are unwritten;
    # with the cache prefilled with NaN any read of either poisons the output.
    b = decode_batch([2, 21, 9, 1], heads=4, kv_heads=2, head_dim=32, block_size=8,
                     fill=float("nan"))
    torch.testing.assert_close(run_kernel(cpu_kernel, b), b.reference, atol=1e-5, rtol=1e-5)


def test_strided_query_and_output(cpu_kernel: DecodeFn) -> None:
    # Query as a view into a fused projection, [B, H, D] rows further apart than H * D.
    b = decode_batch([5, 30, 12], heads=4, kv_heads=2, head_dim=16, block_size=4)
    fused = torch.zeros(3, 2 * 4, 16)
    fused[:, :4] = b.query
    query, out = fused[:, :4], torch.zeros(3, 2 * 4, 16)[:, 4:]
    cpu_kernel(out, query, b.key_cache, b.value_cache, b.block_tables, b.seq_lens, b.scale, 0)
    torch.testing.assert_close(out, b.reference, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("head_dim", [24, 64])
@pytest.mark.parametrize("window", [1, 3, 4, 5, 16, 100])
def test_sliding_window_matches_dense_reference(
    cpu_kernel: DecodeFn, threads: None, window: int, head_dim: int, dtype: torch.dtype
) -> None:
    # Windows inside one block, on block edges, across several blocks and wider than
    # every sequence; NaN in unwritten slots, so reading past the cached tokens shows.
    torch.set_num_threads(2)
    b = decode_batch(LENGTHS, heads=8, kv_heads=2, head_dim=head_dim, block_size=4,
                     dtype=dtype, fill=float("nan"), sliding_window=window)
    tol = TOLERANCE[dtype]
    torch.testing.assert_close(run_kernel(cpu_kernel, b).float(), b.reference, atol=tol, rtol=tol)


def test_negative_window_raises(cpu_kernel: DecodeFn) -> None:
    b = decode_batch([5, 9], heads=4, kv_heads=2, head_dim=16, block_size=4)
    out = torch.empty_like(b.query)
    with pytest.raises(RuntimeError, match="window must be >= 0"):
        cpu_kernel(out, b.query, b.key_cache, b.value_cache, b.block_tables, b.seq_lens,
                   b.scale, -1)


def test_out_of_range_block_id_raises(cpu_kernel: DecodeFn) -> None:
    b = decode_batch([5, 9], heads=4, kv_heads=2, head_dim=16, block_size=4)
    b.block_tables[1, 1] = b.key_cache.shape[0]
    with pytest.raises(RuntimeError, match="out of range"):
        run_kernel(cpu_kernel, b)


def test_dispatch_matches_torch_path(cpu_kernel: DecodeFn, kernels_backend: None) -> None:
    # A mixed batch: prompts on SDPA, decodes on the kernel, stitched back in order.
    b = make_batch([(0, 6), (30, 1), (4, 8), (7, 1), (0, 1)], heads=8, kv_heads=2,
                   head_dim=64, block_size=16)
    set_backend("auto")
    kernel_out = call(b)
    set_backend("torch")
    torch_out = call(b)
    torch.testing.assert_close(kernel_out, torch_out, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(kernel_out, b.reference, atol=1e-5, rtol=1e-5)


def test_failed_build_falls_back_to_torch(
    unbuilt: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    b = decode_batch([5, 30, 12, 1], heads=4, kv_heads=2, head_dim=16, block_size=4)
    set_backend("auto")
    with caplog.at_level(logging.WARNING, logger=cpu_extension.__name__):
        first, second = call(b), call(b)
    set_backend("torch")
    torch_out = call(b)
    assert torch.equal(first, torch_out) and torch.equal(second, torch_out)
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "torch path" in warnings[0].getMessage()


def test_failed_build_raises_when_kernel_required(unbuilt: pytest.MonkeyPatch) -> None:
    b = decode_batch([5, 30], heads=4, kv_heads=2, head_dim=16, block_size=4)
    set_backend("cpp")
    with pytest.raises(RuntimeError, match="Error building"):
        call(b)


def test_torch_backend_never_builds(unbuilt: pytest.MonkeyPatch) -> None:
    def no_build() -> Any:
        raise AssertionError("the torch backend must not build the kernel")

    unbuilt.setattr(cpu_extension, "_build", no_build)
    set_backend("torch")
    b = decode_batch([5, 30], heads=4, kv_heads=2, head_dim=16, block_size=4)
    torch.testing.assert_close(call(b), b.reference, atol=1e-5, rtol=1e-5)


def test_unsupported_dtype_takes_torch_path(unbuilt: pytest.MonkeyPatch) -> None:
    b = decode_batch([5, 30], heads=4, kv_heads=2, head_dim=16, block_size=4,
                     dtype=torch.float16)
    assert cpu_module.cpu_decode_kernel(b.query, b.key_cache) is None


# Lengths around the kernel's 16-token tiles: one short of a tile, exactly one, one over,
# two, and a tile boundary inside or across cache blocks.
TILE_LENGTHS = [15, 16, 17, 1, 31, 32, 33, 50, 7, 64, 100, 47]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("head_dim", [16, 80, 96, 144, 256])
@pytest.mark.parametrize("kv_heads", [8, 4, 2, 1])
def test_head_sizes_and_groups_match_dense_reference(
    cpu_kernel: DecodeFn, threads: None, kv_heads: int, head_dim: int, dtype: torch.dtype
) -> None:
    # 8 query heads in groups of 1, 2, 4 and 8; head sizes that fill whole vectors (16,
    # 256), end in a partial one (80, 96) or take the portable code (144).
    torch.set_num_threads(2)
    b = decode_batch(TILE_LENGTHS, heads=8, kv_heads=kv_heads, head_dim=head_dim,
                     block_size=16, dtype=dtype, fill=float("nan"))
    tol = TOLERANCE[dtype]
    torch.testing.assert_close(run_kernel(cpu_kernel, b).float(), b.reference, atol=tol, rtol=tol)


@pytest.mark.parametrize("num_seqs", [3, 12])
@pytest.mark.parametrize("block_size", [1, 5, 16, 32])
@pytest.mark.parametrize("window", [0, 9, 16, 40])
def test_tiles_across_blocks_match_dense_reference(
    cpu_kernel: DecodeFn, threads: None, block_size: int, window: int, num_seqs: int
) -> None:
    # Tiles of 16 tokens straddle blocks of 1 and 5 tokens, fill a 16-token block, and
    # halve a 32-token one; windows start tiles mid-block. Two threads: 3 sequences split
    # into one item per kv head, 12 run whole.
    torch.set_num_threads(2)
    b = decode_batch(TILE_LENGTHS[:num_seqs], heads=8, kv_heads=2, head_dim=64,
                     block_size=block_size, fill=float("nan"), sliding_window=window or None)
    torch.testing.assert_close(run_kernel(cpu_kernel, b), b.reference, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_many_heads_per_item_match_dense_reference(
    cpu_kernel: DecodeFn, threads: None, dtype: torch.dtype
) -> None:
    # 32 query heads over 4 kv heads at head_dim 128: a whole-sequence item holds more
    # heads than one pass of the value accumulation takes.
    torch.set_num_threads(1)
    b = decode_batch([70, 5, 33, 16], heads=32, kv_heads=4, head_dim=128, block_size=16,
                     dtype=dtype)
    tol = TOLERANCE[dtype]
    torch.testing.assert_close(run_kernel(cpu_kernel, b).float(), b.reference, atol=tol, rtol=tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("window", [0, 9, 100])
@pytest.mark.parametrize(("lengths", "kv_heads"),
                         [([1], 1), ([300], 1), ([17, 1000], 1), ([15, 16, 129], 1),
                          ([515], 3), ([40, 250], 3)])
@pytest.mark.parametrize("num_threads", [2, 3, 8])
def test_token_chunks_match_torch_path(
    cpu_kernel: DecodeFn, threads: None, kernels_backend: None, num_threads: int,
    lengths: list[int], kv_heads: int, window: int, dtype: torch.dtype,
) -> None:
    # Fewer (sequence, kv head) items than the threads can share evenly: each kv head's
    # tokens go to 2 to 16 items whose partial results are merged (one sequence with three
    # kv heads on two threads: two chunks; one with one kv head on eight: sixteen), some of
    # them empty (a 1-token sequence), some cut mid-block or at the window's start.
    torch.set_num_threads(num_threads)
    tol = TOLERANCE[dtype]
    shape = {"heads": 3 * kv_heads, "kv_heads": kv_heads, "head_dim": 64, "block_size": 16,
             "dtype": dtype, "sliding_window": window or None}
    # Unread slots NaN: no chunk reads past its tokens.
    b = decode_batch(lengths, fill=float("nan"), **shape)
    torch.testing.assert_close(run_kernel(cpu_kernel, b).float(), b.reference, atol=tol, rtol=tol)
    # Peaked scores, so that the chunks' running maxima differ (the torch path as reference).
    b = decode_batch(lengths, **shape)
    b.query.mul_(4.0)
    set_backend("torch")
    expected = call(b).float()
    torch.testing.assert_close(run_kernel(cpu_kernel, b).float(), expected, atol=tol, rtol=tol)


@pytest.mark.parametrize("head_dim", [24, 64, 80, 128])
@pytest.mark.parametrize(("lengths", "kv_heads"), [(LENGTHS, 2), ([515], 3), ([40, 250], 1)])
@pytest.mark.parametrize("window", [0, 9])
def test_float16_cache_under_float32_query_matches_dense_reference(
    cpu_kernel: DecodeFn, threads: None, lengths: list[int], kv_heads: int, head_dim: int,
    window: int,
) -> None:
    # --kv-cache-dtype float16 under a float32 model, on every item shape (whole sequences,
    # one kv head each, token chunks) and head sizes with and without a vector tail: keys
    # and values widened as they are read, float32 arithmetic and output. The reference
    # attends over the float16 values, so the float32 tolerance holds.
    torch.set_num_threads(2)
    b = decode_batch(lengths, heads=2 * kv_heads, kv_heads=kv_heads, head_dim=head_dim,
                     block_size=16, fill=float("nan"), sliding_window=window or None,
                     cache_dtype=torch.float16)
    assert b.key_cache.dtype == torch.float16
    out = run_kernel(cpu_kernel, b)
    assert out.dtype == torch.float32
    torch.testing.assert_close(out, b.reference, atol=1e-5, rtol=1e-5)


def test_float16_cache_takes_the_kernel_and_torch_widens_it(
    cpu_kernel: DecodeFn, kernels_backend: None
) -> None:
    b = decode_batch([100, 37, 64], heads=8, kv_heads=2, head_dim=64, block_size=16,
                     cache_dtype=torch.float16)
    assert cpu_module.cpu_decode_kernel(b.query, b.key_cache) is not None
    torch.testing.assert_close(call(b), b.reference, atol=1e-5, rtol=1e-5)
    set_backend("torch")
    torch.testing.assert_close(call(b), b.reference, atol=1e-5, rtol=1e-5)


def test_other_cache_dtypes_are_refused(cpu_kernel: DecodeFn) -> None:
    # bfloat16 under float32, float16 under bfloat16: not served, a clear error.
    for dtype, cache_dtype in [(torch.float32, torch.bfloat16), (torch.bfloat16, torch.float16)]:
        b = decode_batch([5, 30], heads=4, kv_heads=2, head_dim=16, block_size=4, dtype=dtype,
                         cache_dtype=cache_dtype)
        assert cpu_module.cpu_decode_kernel(b.query, b.key_cache) is None
        with pytest.raises(RuntimeError, match="float16 under a float32 query"):
            run_kernel(cpu_kernel, b)


def test_peaked_scores_match_torch_path(cpu_kernel: DecodeFn, kernels_backend: None) -> None:
    # Queries 30x larger: scores spread over hundreds, so the running max jumps between
    # tiles and most weights underflow to zero.
    b = decode_batch([100, 37, 64], heads=8, kv_heads=2, head_dim=64, block_size=16)
    b.query.mul_(30.0)
    set_backend("torch")
    expected = call(b)
    torch.testing.assert_close(run_kernel(cpu_kernel, b), expected, atol=1e-5, rtol=1e-5)


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.skipif(platform.machine() != "x86_64", reason="x86 compiler flags")
@pytest.mark.parametrize("flags", [["-march=x86-64-v3"], ["-mno-avx512bf16"]])
def test_builds_for_other_cpus_match_dense_reference(
    cpu_kernel: DecodeFn, flags: list[str]
) -> None:
    # The portable loops (an AVX2 build) and AVX-512 without bf16 dot products, which this
    # machine's own build never runs; each in a child process (cpu_variant_check). The
    # fixture only skips where there is no compiler.
    root = Path(__file__).resolve().parents[2]
    done = subprocess.run([sys.executable, "-m", "tests.kernels.cpu_variant_check", *flags],
                          cwd=root, capture_output=True, text=True, timeout=540)
    assert done.returncode == 0, done.stderr[-3000:]
