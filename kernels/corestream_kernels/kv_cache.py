"""Writing new keys and values into the block-paged KV cache.

Cache layout, shared with `corestream_kernels.paged_attention`: one tensor per layer for keys
and one for values, each `[num_blocks, block_size, num_kv_heads, head_dim]`. A token's
slot is `block_id * block_size + offset_in_block`, so the cache viewed as
`[num_slots, num_kv_heads, head_dim]` is indexed by the slot directly.

On CUDA with triton installed the write is one Triton kernel
(`corestream_kernels.triton_kv_cache`); elsewhere it is the `index_copy_` below.
"""

from __future__ import annotations

import torch

from corestream_kernels.backend import use_triton


def write_kv_cache(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Store `key`/`value` `[T, num_kv_heads, head_dim]` at `slot_mapping` `[T]` (int64).

    Every slot must be valid (non-negative and inside the cache); padding tokens must
    point at a scratch slot rather than -1, since negative indices would wrap around.
    """
    num_kv_heads, head_dim = key_cache.shape[2], key_cache.shape[3]
    assert key.shape == value.shape and key.shape[1:] == (num_kv_heads, head_dim), (
        key.shape,
        key_cache.shape,
    )
    assert slot_mapping.shape == (key.shape[0],), (slot_mapping.shape, key.shape)
    if use_triton(key):
        from corestream_kernels.triton_kv_cache import write_kv_cache_triton

        write_kv_cache_triton(key, value, key_cache, value_cache, slot_mapping)
        return
    # view (not reshape) so that a non-contiguous cache fails loudly instead of copying.
    key_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, key.to(key_cache.dtype))
    value_cache.view(-1, num_kv_heads, head_dim).index_copy_(
        0, slot_mapping, value.to(value_cache.dtype)
    )
