"""Triton kernels against the dense torch reference.

Without CUDA these run in Triton's interpreter (TRITON_INTERPRET=1) on CPU tensors at
tiny shapes; with CUDA the same tests run compiled, and the `gpu` ones add realistic sizes.
They skip when triton is not installed (it is in the `gpu` extra, not `dev`).
"""

from __future__ import annotations

import os

import pytest
import torch

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
if DEVICE == "cpu":
    # NOTE: triton reads this when a kernel is decorated, so it must precede the first
    # import of kernels.triton_*.
    os.environ.setdefault("TRITON_INTERPRET", "1")

pytest.importorskip("triton")

from kernels.paged_attention import paged_attention  # noqa: E402
from kernels.triton_kv_cache import write_kv_cache_triton  # noqa: E402
from kernels.triton_paged_attention import paged_attention_triton  # noqa: E402
from tests.kernels.paged_batch import PagedBatch, make_batch  # noqa: E402

# fp32 dots run as tf32 on GPUs; the interpreter computes them exactly.
TOLERANCE = {torch.float32: 1e-2 if DEVICE == "cuda" else 1e-4, torch.bfloat16: 3e-2}


def run_triton(batch: PagedBatch) -> torch.Tensor:
    starts = batch.query_start_loc
    return paged_attention_triton(
        batch.query,
        batch.key_cache,
        batch.value_cache,
        batch.block_tables,
        batch.seq_lens,
        torch.tensor(starts, dtype=torch.int32, device=DEVICE),
        max(b - a for a, b in zip(starts, starts[1:], strict=False)),
        batch.scale,
    )


def check(batch: PagedBatch, dtype: torch.dtype) -> None:
    out = run_triton(batch)
    assert out.dtype == dtype and out.shape == batch.query.shape
    tol = TOLERANCE[dtype]
    torch.testing.assert_close(out.float(), batch.reference, atol=tol, rtol=tol)


BATCHES = {
    "decode": [(5, 1), (12, 1), (0, 1), (30, 1)],
    "prefill": [(0, 7), (0, 20)],
    "chunk_after_prefix": [(9, 5), (17, 20)],
    "mixed": [(0, 6), (10, 1), (4, 8), (7, 1), (0, 1), (33, 3)],
}


@pytest.mark.parametrize("kind", BATCHES)
@pytest.mark.parametrize(("heads", "kv_heads"), [(2, 2), (8, 2)], ids=["gqa1", "gqa4"])
def test_attention_tiny(kind: str, heads: int, kv_heads: int) -> None:
    # NaN in every unwritten slot: masked keys and values must never reach the output.
    batch = make_batch(
        BATCHES[kind],
        heads=heads,
        kv_heads=kv_heads,
        head_dim=16,
        block_size=16,
        device=DEVICE,
        fill=float("nan"),
    )
    check(batch, torch.float32)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_attention_bf16_and_odd_head_dim(dtype: torch.dtype) -> None:
    batch = make_batch(
        BATCHES["mixed"],
        heads=6,
        kv_heads=2,
        head_dim=24,
        block_size=16,
        dtype=dtype,
        device=DEVICE,
    )
    check(batch, dtype)


def test_attention_rejects_small_blocks() -> None:
    batch = make_batch([(3, 1)], heads=2, kv_heads=2, head_dim=16, block_size=8, device=DEVICE)
    with pytest.raises(ValueError, match="block_size"):
        run_triton(batch)


@pytest.mark.parametrize(
    ("dtype", "cache_dtype"),
    [
        (torch.float32, torch.float32),
        (torch.bfloat16, torch.bfloat16),
        (torch.float32, torch.bfloat16),  # the cache may be narrower than the model
    ],
)
def test_write_kv_cache(dtype: torch.dtype, cache_dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(0)
    key_cache = torch.zeros(6, 16, 2, 24, dtype=cache_dtype)
    value_cache = torch.zeros_like(key_cache)
    # A strided view, as when keys are sliced out of a fused projection.
    key = torch.randn(5, 3, 2, 24, generator=gen).to(dtype)[:, 1]
    value = torch.randn(5, 2, 24, generator=gen).to(dtype)
    slots = torch.tensor([0, 17, 40, 95, 33])
    expected_keys, expected_values = key_cache.clone(), value_cache.clone()
    expected_keys.view(-1, 2, 24)[slots] = key.to(cache_dtype)
    expected_values.view(-1, 2, 24)[slots] = value.to(cache_dtype)

    key_cache, value_cache = key_cache.to(DEVICE), value_cache.to(DEVICE)
    write_kv_cache_triton(
        key.to(DEVICE), value.to(DEVICE), key_cache, value_cache, slots.to(DEVICE)
    )
    # A cast may round differently: the interpreter truncates fp32 to bf16, GPUs round.
    tol = 0 if dtype == cache_dtype else 2**-7
    torch.testing.assert_close(key_cache.cpu(), expected_keys, atol=tol, rtol=tol)
    torch.testing.assert_close(value_cache.cpu(), expected_values, atol=tol, rtol=tol)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    ("heads", "kv_heads", "head_dim"), [(32, 32, 128), (32, 8, 128), (16, 4, 80)]
)
def test_attention_realistic(dtype: torch.dtype, heads: int, kv_heads: int, head_dim: int) -> None:
    gen = torch.Generator().manual_seed(1)
    decodes = [(int(n), 1) for n in torch.randint(1, 1000, (96,), generator=gen)]
    prefills = [(0, 300), (0, 17), (512, 128), (95, 33), (1000, 1)]
    batch = make_batch(
        prefills + decodes,
        heads=heads,
        kv_heads=kv_heads,
        head_dim=head_dim,
        block_size=16,
        dtype=dtype,
        device=DEVICE,
        fill=float("nan"),
    )
    check(batch, dtype)


@pytest.mark.gpu
def test_dispatch_on_cuda_matches_torch() -> None:
    from kernels.backend import force_torch

    batch = make_batch(
        [(0, 200), (300, 1), (40, 60), (700, 1)],
        heads=32,
        kv_heads=8,
        head_dim=128,
        block_size=16,
        dtype=torch.bfloat16,
        device=DEVICE,
    )
    args = (
        batch.query,
        batch.key_cache,
        batch.value_cache,
        batch.block_tables,
        batch.seq_lens,
        batch.query_start_loc,
        batch.seq_lens_host,
        batch.scale,
    )
    triton_out = paged_attention(*args)
    force_torch(True)
    try:
        torch_out = paged_attention(*args)
    finally:
        force_torch(False)
    torch.testing.assert_close(triton_out.float(), torch_out.float(), atol=3e-2, rtol=3e-2)
