from __future__ import annotations

import math

import pytest
import torch

import kernels.paged_attention as paged_attention_module
from kernels.kv_cache import write_kv_cache
from kernels.paged_attention import paged_attention

NUM_BLOCKS, BLOCK_SIZE, HEADS, KV_HEADS, DIM = 64, 4, 4, 2, 16


def dense_causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """q [q_len, H, D] as the last q_len positions of k, v [seq_len, Hkv, D]."""
    q_len, seq_len = q.shape[0], k.shape[0]
    group = q.shape[1] // k.shape[1]
    k = k.repeat_interleave(group, dim=1)
    v = v.repeat_interleave(group, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q, k) / math.sqrt(q.shape[-1])
    query_pos = torch.arange(seq_len - q_len, seq_len)[:, None]
    scores = scores.masked_fill(torch.arange(seq_len)[None, :] > query_pos, float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), v)


def run_batch(
    shapes: list[tuple[int, int]], dtype: torch.dtype = torch.float32
) -> tuple[torch.Tensor, torch.Tensor]:
    """(paged, reference) outputs for sequences given as (cached prefix, new tokens)."""
    gen = torch.Generator().manual_seed(0)
    key_cache = torch.zeros(NUM_BLOCKS, BLOCK_SIZE, KV_HEADS, DIM, dtype=dtype)
    value_cache = torch.zeros_like(key_cache)
    # Scattered, shuffled blocks, so a wrong table lookup cannot pass by accident.
    free_blocks = torch.randperm(NUM_BLOCKS, generator=gen).tolist()
    max_blocks = max(-(-(p + n) // BLOCK_SIZE) for p, n in shapes)
    tables, queries, refs, starts = [], [], [], [0]
    for prefix, new in shapes:
        seq_len = prefix + new
        blocks = [free_blocks.pop() for _ in range(-(-seq_len // BLOCK_SIZE))]
        tables.append(blocks + [0] * (max_blocks - len(blocks)))
        k = torch.randn(seq_len, KV_HEADS, DIM, generator=gen).to(dtype)
        v = torch.randn(seq_len, KV_HEADS, DIM, generator=gen).to(dtype)
        q = torch.randn(new, HEADS, DIM, generator=gen).to(dtype)
        slots = torch.tensor([blocks[p // BLOCK_SIZE] * BLOCK_SIZE + p % BLOCK_SIZE
                              for p in range(seq_len)])
        write_kv_cache(k, v, key_cache, value_cache, slots)
        queries.append(q)
        refs.append(dense_causal_attention(q.float(), k.float(), v.float()))
        starts.append(starts[-1] + new)
    seq_lens = [p + n for p, n in shapes]
    out = paged_attention(
        torch.cat(queries),
        key_cache,
        value_cache,
        torch.tensor(tables, dtype=torch.int32),
        torch.tensor(seq_lens),
        starts,
        seq_lens,
        1 / math.sqrt(DIM),
    )
    return out, torch.cat(refs)


@pytest.mark.parametrize(
    "shapes",
    [
        [(0, 7)],                          # one whole prompt
        [(9, 5)],                          # a chunk after a cached prefix
        [(5, 1), (12, 1), (0, 1), (3, 1)], # decodes only (batched path)
        [(0, 6), (10, 1), (4, 8), (7, 1), (0, 1)],  # mixed
        [(3, 1), (0, 13), (15, 1)],        # decodes around a prompt
    ],
)
def test_matches_dense_causal_attention(shapes: list[tuple[int, int]]) -> None:
    out, ref = run_batch(shapes)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)


def test_bfloat16() -> None:
    out, ref = run_batch([(0, 6), (10, 1), (4, 8)], dtype=torch.bfloat16)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), ref, atol=3e-2, rtol=3e-2)


def test_padding_table_entries_are_masked() -> None:
    # The short sequence's table is padded with block 0, which holds another sequence's
    # keys; they must not leak into its output.
    out, ref = run_batch([(2, 1), (21, 1)])
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("chunk_bytes", [1, 3000])
def test_decodes_split_into_chunks(monkeypatch: pytest.MonkeyPatch, chunk_bytes: int) -> None:
    # Chunks of one and of a few sequences, each padded to its own longest sequence.
    monkeypatch.setattr(paged_attention_module, "_DECODE_CHUNK_BYTES", chunk_bytes)
    for shapes in ([(5, 1), (30, 1), (0, 1), (12, 1), (2, 1)], [(3, 1), (0, 9), (22, 1), (6, 1)]):
        out, ref = run_batch(shapes)
        torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
