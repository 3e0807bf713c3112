"""Rotary position embedding of queries and keys, fused with the KV-cache write.

Heads use the half-split layout of Llama checkpoints (the first and second halves of a
head are the pairs that rotate together). cos and sin come from
`services.engine.models.rotary_embedding.RotaryEmbedding.cos_sin`, built once per step:
cos is `[cos, cos]` and sin `[-sin, sin]` over the two halves, so a rotation is
`x * cos + swap_halves(x) * sin`, computed in float32 as transformers does.

On CPU the rotation of every q and k head and the write of keys and values into the
cache are one C++ op (`csrc/layers_cpu.cpp`); elsewhere they are `apply_rotary` and
`corestream_kernels.kv_cache.write_kv_cache`, which are also the reference.
"""

from __future__ import annotations

import torch

from corestream_kernels.cpu_extension import DTYPES, cache_dtype_supported, cpu_ops
from corestream_kernels.kv_cache import write_kv_cache


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x `[T, heads, head_dim]` rotated by cos and sin `[T, 1, head_dim]` (float32)."""
    x32 = x.float()
    first, second = x32.chunk(2, dim=-1)
    # x * cos + rotate_half(x) * sin, with rotate_half's minus sign carried by sin.
    return (x32 * cos + torch.cat([second, first], dim=-1) * sin).to(x.dtype)


def rotate_and_store_kv(
    qk: torch.Tensor,
    value: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> torch.Tensor:
    """Rotate qk `[T, q_heads + kv_heads, D]` (query heads, then key heads) and store its
    rotated keys and `value` `[T, kv_heads, D]` at `slot_mapping` `[T]` (int64) in the
    caches `[num_blocks, block_size, kv_heads, D]`.

    Returns the rotated heads: qk itself, rotated in place, where the C++ op runs; a new
    tensor elsewhere.
    """
    if (
        qk.dtype in DTYPES
        and value.dtype == qk.dtype
        and cache_dtype_supported(qk.dtype, key_cache.dtype)
        and value_cache.dtype == key_cache.dtype
        and qk.stride(-1) == 1
        and value.stride(-1) == 1
        and key_cache.is_contiguous()
        and value_cache.is_contiguous()
        and cos.dtype == sin.dtype == torch.float32
        and cos.is_contiguous()
        and sin.is_contiguous()
        and cos.numel() == sin.numel() == qk.shape[0] * qk.shape[2]
        and slot_mapping.dtype == torch.int64
        and slot_mapping.is_contiguous()
        and (ops := cpu_ops(qk)) is not None
    ):
        ops.rotary_store_kv(qk, value, cos, sin, key_cache, value_cache, slot_mapping)
        return qk
    rotated = apply_rotary(qk, cos, sin)
    write_kv_cache(
        rotated[:, -key_cache.shape[2] :], value, key_cache, value_cache, slot_mapping
    )
    return rotated
