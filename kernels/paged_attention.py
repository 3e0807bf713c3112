"""Attention over the block-paged KV cache for one flattened, mixed batch.

The batch concatenates, along the token axis, sequences of three kinds: whole
prompts, prompt chunks whose earlier tokens are already cached (a prefix), and
single-token decodes. Sequence i owns query rows `query_start_loc[i]:query_start_loc[i+1]`
and, after this step's cache write, `seq_lens[i]` cached tokens; its query rows are
the last of those tokens, so query row j sits at position `seq_lens[i] - q_len + j` and
may attend to every cached token up to and including that position.

On CUDA with triton installed this runs one Triton kernel for the whole batch
(`kernels.triton_paged_attention`). On CPU, decodes (the common case, and bound by memory
traffic) go to a C++ kernel that reads the cache in place (`kernels.cpu_paged_attention`),
when it builds. Everything else runs the torch code below, which is also the reference:
it gathers each sequence's blocks into a dense tensor and hands it to
`scaled_dot_product_attention`, decodes in batched calls over chunks of sequences, prompts
and chunks one per call (compute-bound, so SDPA's matmuls suit them). Loop bounds come
from host lists, so no step here waits on the device.
"""

from __future__ import annotations

from collections.abc import Sequence
from itertools import pairwise

import torch
import torch.nn.functional as F

from kernels.backend import use_triton
from kernels.cpu_paged_attention import cpu_decode_kernel

# NOTE: the bytes of keys and values one decode chunk gathers. Gathers much larger than
# this land in freshly mapped pages on every call, and on CPU those page faults cost
# several times the attention itself; chunks this size reuse the allocator's memory
# and stay in cache between the gather and the matmuls.
_DECODE_CHUNK_BYTES = 4 << 20


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
    if use_triton(query):
        return _paged_attention_triton(
            query, key_cache, value_cache, block_tables, seq_lens, query_start_loc_host, scale
        )
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
        _decode(out, query, key_cache, value_cache, block_tables, seq_lens, seq_lens_host, scale)
    elif decodes:
        rows = torch.tensor([query_start_loc_host[i] for i in decodes], device=query.device)
        index = torch.tensor(decodes, device=query.device)
        decode_out = query.new_empty(len(decodes), *query.shape[1:])
        _decode(
            decode_out,
            query[rows],
            key_cache,
            value_cache,
            block_tables[index],
            seq_lens[index],
            [seq_lens_host[i] for i in decodes],
            scale,
        )
        out[rows] = decode_out
    return out


def _paged_attention_triton(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc_host: Sequence[int],
    scale: float,
) -> torch.Tensor:
    from kernels.triton_paged_attention import paged_attention_triton

    # NOTE: one small host-to-device copy per call, because the entry point receives the
    # offsets only as host ints; passing the runner's device copy would remove it.
    query_start_loc = torch.tensor(query_start_loc_host, dtype=torch.int32).to(
        query.device, non_blocking=True
    )
    max_query_len = max((end - start for start, end in pairwise(query_start_loc_host)), default=0)
    return paged_attention_triton(
        query,
        key_cache,
        value_cache,
        block_tables,
        seq_lens,
        query_start_loc,
        max_query_len,
        scale,
    )


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
    keys = key_cache.index_select(0, table).flatten(0, 1)[:seq_len].transpose(0, 1)
    values = value_cache.index_select(0, table).flatten(0, 1)[:seq_len].transpose(0, 1)
    q = query.transpose(0, 1)
    if q_len == seq_len:
        mask = None
    else:
        # Causal mask shifted right by the cached prefix: row j sees keys 0..prefix+j.
        prefix = seq_len - q_len
        rows = torch.arange(prefix, seq_len, device=query.device)
        mask = torch.arange(seq_len, device=query.device)[None, :] <= rows[:, None]
    # NOTE: 4-D inputs: CPU SDPA runs its fused kernel only on [batch, heads, L, D], and
    # falls back to a much slower unfused path for 3-D ones.
    out = F.scaled_dot_product_attention(
        q[None],
        keys[None],
        values[None],
        attn_mask=mask,
        is_causal=mask is None,
        scale=scale,
        enable_gqa=True,
    )[0]
    return out.transpose(0, 1)


def _decode(
    out: torch.Tensor,
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    seq_lens_host: Sequence[int],
    scale: float,
) -> None:
    """One query token per sequence, batched: writes `out` `[B, H, D]` for query `[B, H, D]`."""
    kernel = cpu_decode_kernel(query, key_cache)
    if kernel is not None:
        kernel(
            out,
            query,
            key_cache,
            value_cache,
            block_tables.to(torch.int32).contiguous(),
            seq_lens.to(torch.int32).contiguous(),
            scale,
        )
        return
    _decode_torch(out, query, key_cache, value_cache, block_tables, seq_lens, seq_lens_host, scale)


def _decode_torch(
    out: torch.Tensor,
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    seq_lens_host: Sequence[int],
    scale: float,
) -> None:
    """`_decode` in torch: sequences go in chunks of about `_DECODE_CHUNK_BYTES` of gathered
    keys and values, each padded to its own longest sequence and masked by length.
    """
    _, block_size, num_kv_heads, head_dim = key_cache.shape
    block_bytes = 2 * block_size * num_kv_heads * head_dim * key_cache.element_size()
    max_blocks = -(-max(seq_lens_host) // block_size)
    chunk = max(1, _DECODE_CHUNK_BYTES // (block_bytes * max_blocks))
    for start in range(0, len(seq_lens_host), chunk):
        end = min(start + chunk, len(seq_lens_host))
        num_blocks = -(-max(seq_lens_host[start:end]) // block_size)
        # index_select on the flat table: about twice as fast as advanced indexing on CPU.
        table = block_tables[start:end, :num_blocks].flatten()
        gathered = (end - start, num_blocks * block_size, num_kv_heads, head_dim)
        # [b * num_blocks, block_size, Hkv, D] -> [b, Hkv, num_blocks * block_size, D]
        keys = key_cache.index_select(0, table).view(gathered).transpose(1, 2)
        values = value_cache.index_select(0, table).view(gathered).transpose(1, 2)
        positions = torch.arange(num_blocks * block_size, device=query.device)
        mask = (positions[None, :] < seq_lens[start:end, None])[:, None, None, :]
        # [b, H, 1, D] attends over [b, Hkv, L, D]
        chunk_out = F.scaled_dot_product_attention(
            query[start:end, :, None, :],
            keys,
            values,
            attn_mask=mask,
            scale=scale,
            enable_gqa=True,
        )
        out[start:end] = chunk_out[:, :, 0, :]
