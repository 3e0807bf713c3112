"""Triton kernel for `corestream_kernels.paged_attention.paged_attention` (imported only
when triton is).

One launch covers the whole flattened batch: prompts, chunks after a cached prefix and
decodes alike. The grid is (query blocks, kv heads). A program owns BLOCK_Q consecutive
query tokens of one sequence and every query head that shares kv head `h` (the GQA
group), so each K/V tile it loads serves BLOCK_Q * group rows of the score matrix:

    rows m = t * GROUP_PAD + g   for token t < BLOCK_Q, group member g < GROUP_PAD

It walks that sequence's KV blocks in order through the block table and keeps a running
max and sum (online softmax, as in flash attention), so scores are never materialised.
Query token j of a chunk sits at position prefix + j and sees keys 0 ..= prefix + j:
full attention over the prefix, causal within the chunk, and decodes fall out as q_len 1.
With a sliding window W (SLIDING) it sees only keys above prefix + j - W, and the walk
starts at the first block that the program's first row can see.

Mapping programs to sequences without host work: sequence i's query blocks start at
program `query_start_loc[i] // BLOCK_Q + i`. That start grows by at least
ceil(q_len_i / BLOCK_Q) per sequence, so every program finds its sequence by binary
search and the grid `T // BLOCK_Q + B` always suffices; the programs in the gaps exit.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

LOG2_E = 1.4426950408889634


@triton.jit
def _paged_attention_kernel(
    out_ptr,
    query_ptr,
    key_cache_ptr,
    value_cache_ptr,
    block_tables_ptr,
    seq_lens_ptr,
    query_start_loc_ptr,
    num_seqs,
    window,  # the sliding window, read only when SLIDING
    scale_log2,  # softmax scale * log2(e): the kernel works in base 2
    query_token_stride,
    query_head_stride,
    out_token_stride,
    out_head_stride,
    cache_block_stride,
    cache_slot_stride,
    cache_head_stride,
    block_table_stride,
    GROUP: tl.constexpr,
    GROUP_PAD: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
    UPCAST: tl.constexpr,  # run the dots in fp32 (see the launcher)
    SLIDING: tl.constexpr,
):
    pid = tl.program_id(0)
    kv_head = tl.program_id(1)

    # Last sequence whose first query block starts at or before this program.
    lo = 0
    hi = num_seqs
    while lo < hi:
        mid = (lo + hi) // 2
        if tl.load(query_start_loc_ptr + mid) // BLOCK_Q + mid <= pid:
            lo = mid + 1
        else:
            hi = mid
    seq = lo - 1
    q_start = tl.load(query_start_loc_ptr + seq)
    q_len = tl.load(query_start_loc_ptr + seq + 1) - q_start
    q_block = pid - (q_start // BLOCK_Q + seq)
    if q_block * BLOCK_Q >= q_len:
        return
    seq_len = tl.load(seq_lens_ptr + seq)
    prefix = seq_len - q_len

    rows = tl.arange(0, BLOCK_Q * GROUP_PAD)
    q_idx = q_block * BLOCK_Q + rows // GROUP_PAD  # token index within the chunk
    member = rows % GROUP_PAD
    row_valid = (q_idx < q_len) & (member < GROUP)
    row_pos = prefix + q_idx  # the row's position in the sequence: its causal limit
    head = kv_head * GROUP + member
    dims = tl.arange(0, HEAD_DIM_PAD)
    dim_valid = dims < HEAD_DIM

    token = (q_start + q_idx).to(tl.int64)
    q_offsets = token[:, None] * query_token_stride + head[:, None] * query_head_stride
    q = tl.load(
        query_ptr + q_offsets + dims[None, :],
        mask=row_valid[:, None] & dim_valid[None, :],
        other=0.0,
    )
    if UPCAST:
        q = q.to(tl.float32)

    m_i = tl.full([BLOCK_Q * GROUP_PAD], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_Q * GROUP_PAD], dtype=tl.float32)
    acc = tl.zeros([BLOCK_Q * GROUP_PAD, HEAD_DIM_PAD], dtype=tl.float32)

    # Keys past the last row's position are masked for every row: stop before them.
    last_pos = tl.minimum(prefix + (q_block + 1) * BLOCK_Q, seq_len)
    num_blocks = tl.cdiv(last_pos, BLOCK_SIZE)
    # Keys at or below the first row's position - window are masked for every row.
    first_key = 0
    if SLIDING:
        first_key = tl.maximum(prefix + q_block * BLOCK_Q - window + 1, 0)
    slots = tl.arange(0, BLOCK_SIZE)
    for j in range(first_key // BLOCK_SIZE, num_blocks):
        block_id = tl.load(block_tables_ptr + seq * block_table_stride + j).to(tl.int64)
        kv_offsets = (
            block_id * cache_block_stride
            + slots[:, None] * cache_slot_stride
            + kv_head * cache_head_stride
            + dims[None, :]
        )
        key_pos = j * BLOCK_SIZE + slots
        # NOTE: slots past seq_len in the last block hold stale or uninitialised data,
        # possibly NaN; masking the scores is not enough, since 0 * NaN in p @ v is NaN.
        kv_mask = ((key_pos < seq_len) & (key_pos >= first_key))[:, None] & dim_valid[None, :]
        k = tl.load(key_cache_ptr + kv_offsets, mask=kv_mask, other=0.0)
        v = tl.load(value_cache_ptr + kv_offsets, mask=kv_mask, other=0.0)
        if UPCAST:
            k = k.to(tl.float32)
            v = v.to(tl.float32)

        scores = tl.dot(q, tl.trans(k)) * scale_log2  # [BLOCK_M, BLOCK_SIZE]
        visible = key_pos[None, :] <= row_pos[:, None]
        if SLIDING:
            visible = visible & (key_pos[None, :] > row_pos[:, None] - window)
        scores = tl.where(visible, scores, float("-inf"))
        # Rows that see nothing yet (padding rows, and rows whose window starts in a
        # later block) keep m = -inf; subtracting a finite stand-in keeps exp2 away from
        # -inf - -inf. Every real row sees at least its own key, so none ends empty.
        m_new = tl.maximum(m_i, tl.max(scores, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m_i - m_safe)
        p = tl.exp2(scores - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        m_i = m_new

    acc = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
    out_offsets = token[:, None] * out_token_stride + head[:, None] * out_head_stride
    tl.store(
        out_ptr + out_offsets + dims[None, :],
        acc.to(out_ptr.dtype.element_ty),
        mask=row_valid[:, None] & dim_valid[None, :],
    )


def paged_attention_triton(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    max_query_len: int,
    scale: float,
    sliding_window: int | None = None,
) -> torch.Tensor:
    """Same contract as `corestream_kernels.paged_attention.paged_attention`, with the query offsets
    `query_start_loc` `[B + 1]` int32 on the device and the longest query as a host int."""
    num_tokens, num_heads, head_dim = query.shape
    _, block_size, num_kv_heads, _ = key_cache.shape
    num_seqs = seq_lens.shape[0]
    if num_heads % num_kv_heads:
        raise ValueError(f"num_heads {num_heads} is not a multiple of kv heads {num_kv_heads}")
    if block_size < 16 or block_size & (block_size - 1):
        # A KV block is one tile of the score matrix, and tl.dot needs power-of-two
        # tile sides of at least 16.
        raise ValueError(f"Triton attention needs a power-of-two block_size >= 16: {block_size}")
    group = num_heads // num_kv_heads
    group_pad = triton.next_power_of_2(group)
    # Decodes fill a tile with their group; longer queries also stack tokens, up to 64 rows.
    rows = 16 if max_query_len <= 1 else 64
    block_q = max(1, rows // group_pad)

    # query, out: [T, H, D] with unit stride over D.
    assert query.stride(2) == 1, query.stride()
    # key_cache, value_cache: [num_blocks, block_size, Hkv, D], identical strides, unit over D.
    assert value_cache.shape == key_cache.shape and value_cache.stride() == key_cache.stride()
    assert key_cache.stride(3) == 1 and key_cache.shape[3] == head_dim, key_cache.stride()
    # block_tables: [B, max_blocks] int32, unit stride over blocks.
    assert block_tables.shape[0] == num_seqs and block_tables.stride(1) == 1
    # seq_lens: [B]; query_start_loc: [B + 1] int32, both contiguous.
    assert seq_lens.is_contiguous() and query_start_loc.shape == (num_seqs + 1,)
    assert query_start_loc.is_contiguous() and query_start_loc.dtype == torch.int32

    out = torch.empty_like(query)
    if num_tokens == 0:
        return out
    grid = (num_tokens // block_q + num_seqs, num_kv_heads)
    _paged_attention_kernel[grid](
        out,
        query,
        key_cache,
        value_cache,
        block_tables,
        seq_lens,
        query_start_loc,
        num_seqs,
        sliding_window or 0,
        scale * LOG2_E,
        query.stride(0),
        query.stride(1),
        out.stride(0),
        out.stride(1),
        key_cache.stride(0),
        key_cache.stride(1),
        key_cache.stride(2),
        block_tables.stride(0),
        GROUP=group,
        GROUP_PAD=group_pad,
        BLOCK_Q=block_q,
        BLOCK_SIZE=block_size,
        HEAD_DIM=head_dim,
        HEAD_DIM_PAD=max(16, triton.next_power_of_2(head_dim)),
        # NOTE: CPU tensors only get here under TRITON_INTERPRET=1, whose tl.dot
        # computes garbage from bf16 operands (triton 3.9); fp32 dots there are exact.
        UPCAST=query.device.type == "cpu",
        SLIDING=sliding_window is not None,
    )
    return out
