"""Attention over the block-paged KV cache for one flattened, mixed batch.

The batch concatenates, along the token axis, sequences of three kinds: whole
prompts, prompt chunks whose earlier tokens are already cached (a prefix), and
single-token decodes. Sequence i owns query rows `query_start_loc[i]:query_start_loc[i+1]`
and, after this step's cache write, `seq_lens[i]` cached tokens; its query rows are
the last of those tokens, so query row j sits at position `seq_lens[i] - q_len + j` and
may attend to every cached token up to and including that position. With a sliding
window W it attends only to the last W of those: a query at position p sees keys at
positions k with p - W < k <= p (transformers' `sliding_window_overlay`, itself included).
Every block stays in the cache even once it has slid out of every window; freeing such
blocks would save memory on long contexts, and is left to a later change.

On CUDA with triton installed this runs one Triton kernel for the whole batch
(`corestream_kernels.triton_paged_attention`). On CPU, decodes (the common case, and bound by memory
traffic) go to a C++ kernel that reads the cache in place, and prompts and chunks to
another that runs every one of them in one call (`corestream_kernels.cpu_paged_attention`),
when they build. Everything else runs the torch code below, which is also the reference:
it gathers each sequence's blocks into a dense tensor and hands it to
`scaled_dot_product_attention`, decodes in batched calls over chunks of sequences, prompts
and chunks one per call. Loop bounds come from host lists, so no step here waits on the
device.
"""

from __future__ import annotations

from collections.abc import Sequence
from itertools import pairwise

import torch
import torch.nn.functional as F

from corestream_kernels.backend import use_triton
from corestream_kernels.cpu_paged_attention import cpu_decode_kernel, cpu_prefill_kernel

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
    query_start_loc: torch.Tensor,
    query_start_loc_host: Sequence[int],
    seq_lens_host: Sequence[int],
    scale: float,
    sliding_window: int | None = None,
) -> torch.Tensor:
    """Attention output `[T, num_heads, head_dim]` for `query` `[T, num_heads, head_dim]`.

    key_cache, value_cache: `[num_blocks, block_size, num_kv_heads, head_dim]`.
    block_tables: `[B, max_blocks]` integer block ids per sequence; unused entries must
        still be valid block ids (their contents are masked out).
    seq_lens: `[B]` cached tokens per sequence after this step, on the query's device.
    query_start_loc: `[B + 1]` int32 offsets of each sequence's rows, on the query's
        device; built once per step and shared by every layer, so no layer copies them.
    query_start_loc_host, seq_lens_host: the same offsets and lengths as host ints.
    sliding_window: attend only to this many latest positions (None: all of them).
    """
    num_seqs = len(seq_lens_host)
    assert len(query_start_loc_host) == num_seqs + 1, "query_start_loc needs B + 1 entries"
    assert query_start_loc_host[-1] == query.shape[0], "query_start_loc must end at T"
    if sliding_window is not None and sliding_window < 1:
        raise ValueError(f"sliding_window must be >= 1, got {sliding_window}")
    if use_triton(query):
        from corestream_kernels.triton_paged_attention import paged_attention_triton

        max_query_len = max(
            (end - start for start, end in pairwise(query_start_loc_host)), default=0
        )
        return paged_attention_triton(
            query,
            key_cache,
            value_cache,
            block_tables,
            seq_lens,
            query_start_loc,
            max_query_len,
            scale,
            sliding_window,
        )
    out = torch.empty_like(query)
    if num_seqs == 0:
        return out
    lengths = [end - start for start, end in pairwise(query_start_loc_host)]
    decodes = [i for i, n in enumerate(lengths) if n == 1]
    prefills = [i for i, n in enumerate(lengths) if n > 1]
    if prefills:
        # Looked up only here: an all-decode step (most steps) never asks for it.
        prefill_kernel = cpu_prefill_kernel(query, key_cache)
        if prefill_kernel is not None:
            prefill_kernel(
                out,
                query,
                key_cache,
                value_cache,
                block_tables.to(torch.int32).contiguous(),
                seq_lens.to(torch.int32).contiguous(),
                query_start_loc.to(torch.int32).contiguous(),
                scale,
                sliding_window or 0,
            )
        else:
            for i in prefills:
                start, end = query_start_loc_host[i], query_start_loc_host[i + 1]
                out[start:end] = _prefill(
                    query[start:end],
                    key_cache,
                    value_cache,
                    block_tables[i],
                    seq_lens_host[i],
                    scale,
                    sliding_window,
                )
    if len(decodes) == num_seqs:
        # Every row is a decode and rows are in sequence order: no gather, no scatter.
        _decode(
            out,
            query,
            key_cache,
            value_cache,
            block_tables,
            seq_lens,
            seq_lens_host,
            scale,
            sliding_window,
        )
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
            sliding_window,
        )
        out[rows] = decode_out
    return out


def _prefill(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_len: int,
    scale: float,
    sliding_window: int | None,
) -> torch.Tensor:
    """One sequence's chunk: query `[q_len, H, D]` over its first `seq_len` cached tokens."""
    q_len = query.shape[0]
    prefix = seq_len - q_len
    block_size = key_cache.shape[1]
    # Keys before the first row's window are invisible to every row: skip their blocks.
    first_key = 0 if sliding_window is None else max(0, prefix - sliding_window + 1)
    first_block = first_key // block_size
    table = block_table[first_block : -(-seq_len // block_size)]
    offset = first_block * block_size  # position of the first gathered key
    # [num_blocks, block_size, Hkv, D] -> [Hkv, seq_len - offset, D]
    keys = key_cache.index_select(0, table).flatten(0, 1)[: seq_len - offset].transpose(0, 1)
    values = value_cache.index_select(0, table).flatten(0, 1)[: seq_len - offset].transpose(0, 1)
    # A float16 cache under float32 activations (--kv-cache-dtype) is widened to them.
    keys, values = keys.to(query.dtype), values.to(query.dtype)
    q = query.transpose(0, 1)
    if q_len == seq_len and (sliding_window is None or sliding_window >= seq_len):
        mask = None
    else:
        # Causal mask shifted right by the cached prefix: row j sees keys up to
        # prefix + j, and with a window only the last `sliding_window` of those.
        rows = torch.arange(prefix, seq_len, device=query.device)[:, None]
        key_pos = torch.arange(offset, seq_len, device=query.device)[None, :]
        mask = key_pos <= rows
        if sliding_window is not None:
            mask &= key_pos > rows - sliding_window
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
    sliding_window: int | None,
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
            sliding_window or 0,
        )
        return
    _decode_torch(
        out,
        query,
        key_cache,
        value_cache,
        block_tables,
        seq_lens,
        seq_lens_host,
        scale,
        sliding_window,
    )


def _decode_torch(
    out: torch.Tensor,
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    seq_lens_host: Sequence[int],
    scale: float,
    sliding_window: int | None,
) -> None:
    """`_decode` in torch: sequences go in chunks of about `_DECODE_CHUNK_BYTES` of gathered
    keys and values, each padded to its own longest sequence and masked by length (and by
    the window: the one query sits at position seq_len - 1).
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
        keys = key_cache.index_select(0, table).view(gathered).transpose(1, 2).to(query.dtype)
        values = value_cache.index_select(0, table).view(gathered).transpose(1, 2).to(query.dtype)
        positions = torch.arange(num_blocks * block_size, device=query.device)
        lens = seq_lens[start:end, None]
        mask = positions[None, :] < lens
        if sliding_window is not None:
            mask &= positions[None, :] >= lens - sliding_window
        mask = mask[:, None, None, :]
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
