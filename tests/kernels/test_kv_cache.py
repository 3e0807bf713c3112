from __future__ import annotations

import torch
from corestream_kernels.kv_cache import write_kv_cache


def test_write_places_each_token_at_its_slot() -> None:
    num_blocks, block_size, heads, dim = 6, 4, 2, 8
    key_cache = torch.zeros(num_blocks, block_size, heads, dim)
    value_cache = torch.zeros_like(key_cache)
    key, value = torch.randn(5, heads, dim), torch.randn(5, heads, dim)
    slots = torch.tensor([0, 5, 9, 23, 14])

    write_kv_cache(key, value, key_cache, value_cache, slots)

    for token, slot in enumerate(slots.tolist()):
        block, offset = divmod(slot, block_size)
        assert torch.equal(key_cache[block, offset], key[token])
        assert torch.equal(value_cache[block, offset], value[token])
    written = torch.zeros(num_blocks * block_size, dtype=torch.bool)
    written[slots] = True
    assert not key_cache.view(-1, heads, dim)[~written].any()


def test_write_casts_to_the_cache_dtype() -> None:
    key_cache = torch.zeros(2, 4, 1, 4, dtype=torch.bfloat16)
    value_cache = torch.zeros_like(key_cache)
    key = torch.randn(1, 1, 4)
    write_kv_cache(key, key, key_cache, value_cache, torch.tensor([3]))
    assert torch.equal(key_cache[0, 3], key[0].to(torch.bfloat16))
