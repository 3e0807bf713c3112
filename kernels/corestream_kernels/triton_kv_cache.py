"""Triton kernel for `corestream_kernels.kv_cache.write_kv_cache` (imported only when triton is).

One program per token copies that token's `num_kv_heads * head_dim` keys and values
into its slot. Both sides are contiguous over (head, dim), so a token is one flat
vector and the copy needs no per-head indexing.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _write_kv_kernel(
    key_ptr,
    value_ptr,
    key_cache_ptr,
    value_cache_ptr,
    slot_mapping_ptr,
    key_token_stride,
    value_token_stride,
    cache_slot_stride,
    ROW: tl.constexpr,  # num_kv_heads * head_dim
    ROW_PAD: tl.constexpr,
):
    token = tl.program_id(0)
    slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
    cols = tl.arange(0, ROW_PAD)
    in_row = cols < ROW
    key = tl.load(key_ptr + token * key_token_stride + cols, mask=in_row)
    value = tl.load(value_ptr + token * value_token_stride + cols, mask=in_row)
    dst = slot * cache_slot_stride + cols
    tl.store(key_cache_ptr + dst, key.to(key_cache_ptr.dtype.element_ty), mask=in_row)
    tl.store(value_cache_ptr + dst, value.to(value_cache_ptr.dtype.element_ty), mask=in_row)


def write_kv_cache_triton(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Same contract as `corestream_kernels.kv_cache.write_kv_cache`."""
    num_tokens = key.shape[0]
    num_kv_heads, head_dim = key_cache.shape[2], key_cache.shape[3]
    row = num_kv_heads * head_dim
    # key, value: [T, Hkv, D], each token's (Hkv, D) contiguous; the token stride is free,
    # so slices of a fused qkv projection need no copy.
    for t in (key, value):
        assert t.shape == (num_tokens, num_kv_heads, head_dim), (t.shape, key_cache.shape)
        assert t.stride(2) == 1 and t.stride(1) == head_dim, t.stride()
    # key_cache, value_cache: [num_blocks, block_size, Hkv, D], contiguous, so that slot
    # s starts at s * row.
    assert value_cache.shape == key_cache.shape
    for cache in (key_cache, value_cache):
        assert cache.is_contiguous(), cache.stride()
    # slot_mapping: [T]
    assert slot_mapping.shape == (num_tokens,) and slot_mapping.is_contiguous()
    if num_tokens == 0:
        return
    _write_kv_kernel[(num_tokens,)](
        key,
        value,
        key_cache,
        value_cache,
        slot_mapping,
        key.stride(0),
        value.stride(0),
        row,
        ROW=row,
        ROW_PAD=triton.next_power_of_2(row),
    )
