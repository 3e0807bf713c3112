"""The C++ CPU prefill kernel (`paged_prefill`) against the dense reference."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import torch
from corestream_kernels.backend import set_backend
from corestream_kernels.cpu_paged_attention import PrefillFn
from corestream_kernels.paged_attention import paged_attention

from tests.kernels.paged_batch import PagedBatch, make_batch

TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 3e-2}
UNTOUCHED = 7.0  # what the kernel must leave in the rows of decodes

# (cached prefix, new tokens): whole prompts around the kernel's 16- and 32-key tiles,
# chunks after a prefix that ends mid-block, decodes it must leave alone, an empty entry.
SHAPES = [(0, 7), (0, 2), (9, 5), (3, 1), (0, 33), (40, 70), (0, 1), (17, 16), (5, 0), (0, 130)]


@pytest.fixture
def kernel(cpu_ops: Any) -> PrefillFn:
    return cpu_ops.paged_prefill


@pytest.fixture
def threads() -> Iterator[None]:
    previous = torch.get_num_threads()
    yield
    torch.set_num_threads(previous)


def run_kernel(kernel: PrefillFn, b: PagedBatch) -> torch.Tensor:
    out = torch.full_like(b.query, UNTOUCHED)
    kernel(out, b.query, b.key_cache, b.value_cache, b.block_tables, b.seq_lens,
           b.query_start_loc, b.scale, b.sliding_window or 0)
    return out


def prefill_rows(b: PagedBatch) -> torch.Tensor:
    """A mask over the batch's rows: True where the row belongs to a 2+ row sequence."""
    rows = torch.zeros(b.query.shape[0], dtype=torch.bool)
    starts = b.query_start_loc_host
    for start, end in zip(starts, starts[1:], strict=False):
        if end - start >= 2:
            rows[start:end] = True
    return rows


def assert_matches(kernel: PrefillFn, b: PagedBatch, dtype: torch.dtype) -> None:
    out = run_kernel(kernel, b)
    assert out.dtype == dtype
    rows = prefill_rows(b)
    tol = TOLERANCE[dtype]
    torch.testing.assert_close(out[rows].float(), b.reference[rows], atol=tol, rtol=tol)
    assert bool((out[~rows] == UNTOUCHED).all()), "a decode's rows were written"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("head_dim", [24, 64, 128])
@pytest.mark.parametrize("block_size", [1, 5, 16])
@pytest.mark.parametrize(("heads", "kv_heads"), [(4, 4), (6, 2), (7, 1)])
def test_matches_dense_reference(
    kernel: PrefillFn, threads: None, heads: int, kv_heads: int, block_size: int,
    head_dim: int, dtype: torch.dtype,
) -> None:
    # Groups of 1, 3 and 7 query heads per kv head (items of 64, 66 and 70 rows: never a
    # whole number of the kernel's row blocks); head sizes compiled in (64, 128) and not
    # (24); NaN in every unwritten cache slot, so a read past the cached tokens shows.
    torch.set_num_threads(2)
    b = make_batch(SHAPES, heads=heads, kv_heads=kv_heads, head_dim=head_dim,
                   block_size=block_size, dtype=dtype, fill=float("nan"))
    assert_matches(kernel, b, dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("window", [1, 3, 16, 31, 40, 500])
def test_sliding_window_matches_dense_reference(
    kernel: PrefillFn, threads: None, window: int, dtype: torch.dtype
) -> None:
    # Windows of one token, inside a key tile, on and across tile edges, and wider than
    # every sequence; the prefix's first blocks fall out of every row's window.
    torch.set_num_threads(2)
    b = make_batch(SHAPES, heads=8, kv_heads=2, head_dim=64, block_size=4, dtype=dtype,
                   fill=float("nan"), sliding_window=window)
    assert_matches(kernel, b, dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("head_dim", [16, 80, 96, 256])
def test_other_head_sizes(kernel: PrefillFn, head_dim: int, dtype: torch.dtype) -> None:
    # bfloat16 at 16 and 80: rows that end in half a vector (the bf16 dot products' copies).
    b = make_batch([(0, 20), (11, 9)], heads=4, kv_heads=2, head_dim=head_dim, block_size=8,
                   dtype=dtype, fill=float("nan"))
    assert_matches(kernel, b, dtype)


def test_strided_query_and_output(kernel: PrefillFn) -> None:
    # Query as a view into a fused projection, rows further apart than H * D.
    b = make_batch([(0, 9), (4, 6)], heads=4, kv_heads=2, head_dim=16, block_size=4)
    fused = torch.zeros(15, 3 * 4, 16)
    fused[:, :4] = b.query
    query, out = fused[:, :4], torch.zeros(15, 3 * 4, 16)[:, 8:]
    kernel(out, query, b.key_cache, b.value_cache, b.block_tables, b.seq_lens,
           b.query_start_loc, b.scale, 0)
    torch.testing.assert_close(out, b.reference, atol=1e-5, rtol=1e-5)


def test_peaked_scores(kernel: PrefillFn, kernels_backend: None) -> None:
    # Queries 30x larger: the running max jumps from tile to tile and most weights
    # underflow to zero. The reference is the torch path on the same queries.
    b = make_batch([(0, 100), (37, 27)], heads=8, kv_heads=2, head_dim=64, block_size=16)
    b.query.mul_(30.0)
    set_backend("torch")
    expected = paged_attention(*b.args())
    torch.testing.assert_close(run_kernel(kernel, b), expected, atol=1e-5, rtol=1e-5)


def test_out_of_range_block_id_raises(kernel: PrefillFn) -> None:
    b = make_batch([(0, 5), (3, 6)], heads=4, kv_heads=2, head_dim=16, block_size=4)
    b.block_tables[1, 2] = b.key_cache.shape[0]
    with pytest.raises(RuntimeError, match="out of range"):
        run_kernel(kernel, b)


def test_fewer_cached_tokens_than_query_rows_raises(kernel: PrefillFn) -> None:
    b = make_batch([(0, 5), (3, 6)], heads=4, kv_heads=2, head_dim=16, block_size=4)
    b.seq_lens[1] = 4
    with pytest.raises(RuntimeError, match="shorter than its 6 query rows"):
        run_kernel(kernel, b)


def test_query_start_loc_must_cover_the_query(kernel: PrefillFn) -> None:
    b = make_batch([(0, 5), (3, 6)], heads=4, kv_heads=2, head_dim=16, block_size=4)
    b.query_start_loc[-1] = 10
    with pytest.raises(RuntimeError, match="query_start_loc must run from 0"):
        run_kernel(kernel, b)


def test_paged_attention_takes_it_for_prompts(
    cpu_ops: Any, kernels_backend: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A mixed batch through the entry point: prompts and chunks in one kernel call, decodes
    # on the decode kernel, and SDPA never called.
    import corestream_kernels.paged_attention as module

    def no_sdpa(*args: object, **kwargs: object) -> None:
        raise AssertionError("a prompt took the torch path")

    b = make_batch([(0, 6), (30, 1), (4, 8), (7, 1), (0, 1), (0, 40)], heads=8, kv_heads=2,
                   head_dim=64, block_size=16)
    set_backend("torch")
    torch_out = paged_attention(*b.args())
    set_backend("auto")
    monkeypatch.setattr(module.F, "scaled_dot_product_attention", no_sdpa)
    kernel_out = paged_attention(*b.args())
    torch.testing.assert_close(kernel_out, torch_out, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(kernel_out, b.reference, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("head_dim", [24, 64, 128])
@pytest.mark.parametrize("window", [0, 16])
def test_float16_cache_under_float32_query_matches_dense_reference(
    kernel: PrefillFn, threads: None, head_dim: int, window: int
) -> None:
    # --kv-cache-dtype float16 under a float32 model: keys and values widened as they are
    # read, the arithmetic and the output float32; the reference attends over the float16
    # values, so the float32 tolerance holds.
    torch.set_num_threads(2)
    b = make_batch(SHAPES, heads=6, kv_heads=2, head_dim=head_dim, block_size=5,
                   fill=float("nan"), sliding_window=window or None,
                   cache_dtype=torch.float16)
    assert b.key_cache.dtype == torch.float16
    assert_matches(kernel, b, torch.float32)


def test_float16_cache_takes_the_kernel_not_torch(kernel: PrefillFn,
                                                  kernels_backend: None) -> None:
    # The dispatch sends a float16 cache under a float32 query to the kernel, and the torch
    # path (set_backend("torch")) widens the cache as well: both match the reference.
    b = make_batch([(0, 20), (11, 9)], heads=4, kv_heads=2, head_dim=64, block_size=8,
                   cache_dtype=torch.float16)
    expected = b.reference
    torch.testing.assert_close(paged_attention(*b.args()), expected, atol=1e-5, rtol=1e-5)
    set_backend("torch")
    torch.testing.assert_close(paged_attention(*b.args()), expected, atol=1e-5, rtol=1e-5)


def test_other_cache_dtypes_are_refused(kernel: PrefillFn) -> None:
    # A bfloat16 cache under float32 is not served: a clear error, nothing written.
    b = make_batch([(0, 9)], heads=4, kv_heads=2, head_dim=16, block_size=4,
                   cache_dtype=torch.bfloat16)
    with pytest.raises(RuntimeError, match="float16 under a float32 query"):
        run_kernel(kernel, b)
