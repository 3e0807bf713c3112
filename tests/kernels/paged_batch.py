"""Random paged batches and a dense attention reference, shared by the kernel tests."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from corestream_kernels.kv_cache import write_kv_cache


@dataclass
class PagedBatch:
    query: torch.Tensor  # [T, H, D]
    key_cache: torch.Tensor  # [num_blocks, block_size, Hkv, D]
    value_cache: torch.Tensor
    block_tables: torch.Tensor  # [B, max_blocks] int32, padded with block 0
    seq_lens: torch.Tensor  # [B] int32
    query_start_loc: torch.Tensor  # [B + 1] int32
    query_start_loc_host: list[int]
    seq_lens_host: list[int]
    reference: torch.Tensor  # [T, H, D] float32
    scale: float
    sliding_window: int | None

    def args(self) -> tuple[object, ...]:
        """The positional arguments of `corestream_kernels.paged_attention.paged_attention`."""
        return (
            self.query,
            self.key_cache,
            self.value_cache,
            self.block_tables,
            self.seq_lens,
            self.query_start_loc,
            self.query_start_loc_host,
            self.seq_lens_host,
            self.scale,
            self.sliding_window,
        )


def dense_causal_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, sliding_window: int | None = None
) -> torch.Tensor:
    """q [q_len, H, D] as the last q_len positions of k, v [seq_len, Hkv, D].

    With a window W, the query at position p sees keys at k with p - W < k <= p.
    """
    q_len, seq_len = q.shape[0], k.shape[0]
    group = q.shape[1] // k.shape[1]
    k = k.repeat_interleave(group, dim=1)
    v = v.repeat_interleave(group, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q, k) / math.sqrt(q.shape[-1])
    query_pos = torch.arange(seq_len - q_len, seq_len)[:, None]
    key_pos = torch.arange(seq_len)[None, :]
    hidden = key_pos > query_pos
    if sliding_window is not None:
        hidden |= key_pos <= query_pos - sliding_window
    scores = scores.masked_fill(hidden, float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), v)


def make_batch(
    shapes: list[tuple[int, int]],
    *,
    heads: int,
    kv_heads: int,
    head_dim: int,
    block_size: int,
    dtype: torch.dtype = torch.float32,
    device: str = "cpu",
    fill: float = 0.0,
    seed: int = 0,
    sliding_window: int | None = None,
    cache_dtype: torch.dtype | None = None,
) -> PagedBatch:
    """Sequences given as (cached prefix, new tokens); unwritten cache slots hold `fill`.
    The cache has `cache_dtype` (default: `dtype`); the reference attends over the keys and
    values as the cache holds them."""
    cache_dtype = cache_dtype or dtype
    gen = torch.Generator().manual_seed(seed)
    blocks_per_seq = [-(-(p + n) // block_size) for p, n in shapes]
    num_blocks = sum(blocks_per_seq) + 4
    key_cache = torch.full((num_blocks, block_size, kv_heads, head_dim), fill, dtype=cache_dtype)
    value_cache = torch.full_like(key_cache, fill)
    # Scattered, shuffled blocks, so a wrong table lookup cannot pass by accident.
    free_blocks = torch.randperm(num_blocks, generator=gen).tolist()
    width = max(blocks_per_seq)
    tables, queries, refs, starts = [], [], [], [0]
    for (prefix, new), n in zip(shapes, blocks_per_seq, strict=True):
        seq_len = prefix + new
        blocks = [free_blocks.pop() for _ in range(n)]
        tables.append(blocks + [0] * (width - n))
        k = torch.randn(seq_len, kv_heads, head_dim, generator=gen).to(cache_dtype)
        v = torch.randn(seq_len, kv_heads, head_dim, generator=gen).to(cache_dtype)
        q = torch.randn(new, heads, head_dim, generator=gen).to(dtype)
        slots = torch.tensor(
            [blocks[p // block_size] * block_size + p % block_size for p in range(seq_len)]
        )
        write_kv_cache(k, v, key_cache, value_cache, slots)
        queries.append(q)
        refs.append(dense_causal_attention(q.float(), k.float(), v.float(), sliding_window))
        starts.append(starts[-1] + new)
    seq_lens = [p + n for p, n in shapes]
    return PagedBatch(
        query=torch.cat(queries).to(device),
        key_cache=key_cache.to(device),
        value_cache=value_cache.to(device),
        block_tables=torch.tensor(tables, dtype=torch.int32, device=device),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
        query_start_loc=torch.tensor(starts, dtype=torch.int32, device=device),
        query_start_loc_host=starts,
        seq_lens_host=seq_lens,
        reference=torch.cat(refs).to(device),
        scale=head_dim**-0.5,
        sliding_window=sliding_window,
    )
