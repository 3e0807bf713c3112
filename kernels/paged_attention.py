"""Attention over the block-paged KV cache for one flattened, mixed batch (torch).

The batch concatenates, along the token axis, sequences of three kinds: whole
prompts, prompt chunks whose earlier tokens are already cached (a prefix), and
single-token decodes. Sequence i owns query rows `query_start_loc[i]:query_start_loc[i+1]`
and, after this step's cache write, `seq_lens[i]` cached tokens; its query rows are
the last of those tokens, so query row j sits at position `seq_lens[i] - q_len + j` and
may attend to every cached token up to and including that position.

This is the reference and CPU implementation: it gathers each sequence's blocks
into a dense tensor and hands it to `scaled_dot_product_attention`. Decodes, the
common case, go through one batched call; prompts and chunks go one per call.
Loop bounds come from host lists, so no step here waits on the device.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F


def paged_attention(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc_host: Sequence[int],
    seq_lens_host: Sequence[int],
    scale: float,
) -> torch.Tensor:
    """Attention output `[T, num_heads, head_dim]` for `query` `[T, num_heads, head_dim]`.

    key_cache, value_cache: `[num_blocks, block_size, num_kv_heads, head_dim]`.
    block_tables: `[B, max_blocks]` integer block ids per sequence; unused entries must
        still be valid block ids (their contents are masked out).
    seq_lens: `[B]` cached tokens per sequence after this step, on the query's device.
    query_start_loc_host, seq_lens_host: the same offsets and lengths as host ints.
    """
    num_seqs = len(seq_lens_host)
    assert len(query_start_loc_host) == num_seqs + 1, "query_start_loc needs B + 1 entries"
    assert query_start_loc_host[-1] == query.shape[0], "query_start_loc must end at T"
    out = torch.empty_like(query)
    if num_seqs == 0:
        return out
    decodes: list[int] = []
    for i in range(num_seqs):
        start, end = query_start_loc_host[i], query_start_loc_host[i + 1]
        if end - start == 1:
            decodes.append(i)
        elif end > start:
            out[start:end] = _prefill(
                query[start:end], key_cache, value_cache, block_tables[i], seq_lens_host[i], scale
            )
    if len(decodes) == num_seqs:
        # Every row is a decode and rows are in sequence order: no gather, no scatter.
        return _decode(query, key_cache, value_cache, block_tables, seq_lens, seq_lens_host, scale)
    if decodes:
        rows = [query_start_loc_host[i] for i in decodes]
        index = torch.tensor(decodes, device=query.device)
        out[rows] = _decode(
            query[rows],
            key_cache,
            value_cache,
            block_tables[index],
            seq_lens[index],
            [seq_lens_host[i] for i in decodes],
            scale,
        )
    return out


def _prefill(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_len: int,
    scale: float,
) -> torch.Tensor:
    """One sequence's chunk: query `[q_len, H, D]` over its first `seq_len` cached tokens."""
    q_len = query.shape[0]
    num_blocks = -(-seq_len // key_cache.shape[1])
    table = block_table[:num_blocks]
    # [num_blocks, block_size, Hkv, D] -> [Hkv, seq_len, D]
    keys = key_cache[table].flatten(0, 1)[:seq_len].transpose(0, 1)
    values = value_cache[table].flatten(0, 1)[:seq_len].transpose(0, 1)
    q = query.transpose(0, 1)
    if q_len == seq_len:
        mask = None
    else:
        # Causal mask shifted right by the cached prefix: row j sees keys 0..prefix+j.
        prefix = seq_len - q_len
        rows = torch.arange(prefix, seq_len, device=query.device)
        mask = torch.arange(seq_len, device=query.device)[None, :] <= rows[:, None]
    out = F.scaled_dot_product_attention(
        q, keys, values, attn_mask=mask, is_causal=mask is None, scale=scale, enable_gqa=True
    )
    return out.transpose(0, 1)


def _decode(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    seq_lens_host: Sequence[int],
    scale: float,
) -> torch.Tensor:
    """One query token per sequence, batched: query `[B, H, D]` -> `[B, H, D]`."""
    block_size = key_cache.shape[1]
    num_blocks = -(-max(seq_lens_host) // block_size)
    table = block_tables[:, :num_blocks]
    # [B, num_blocks, block_size, Hkv, D] -> [B, Hkv, num_blocks * block_size, D]
    keys = key_cache[table].flatten(1, 2).transpose(1, 2)
    values = value_cache[table].flatten(1, 2).transpose(1, 2)
    positions = torch.arange(num_blocks * block_size, device=query.device)
    mask = (positions[None, :] < seq_lens[:, None])[:, None, None, :]
    out = F.scaled_dot_product_attention(
        query[:, :, None, :], keys, values, attn_mask=mask, scale=scale, enable_gqa=True
    )
    return out[:, :, 0, :]
