from __future__ import annotations

import pytest
import torch

import kernels.paged_attention as paged_attention_module
from kernels.backend import set_backend
from kernels.paged_attention import paged_attention
from tests.kernels.paged_batch import make_batch

BLOCK_SIZE, HEADS, KV_HEADS, DIM = 4, 4, 2, 16


@pytest.fixture(autouse=True, params=["torch", "cpp"])
def backend(request: pytest.FixtureRequest, kernels_backend: None) -> str:
    """Every test runs on the torch path and with CPU decodes on the C++ kernel."""
    if request.param == "cpp":
        request.getfixturevalue("cpu_kernel")
    set_backend(request.param)
    return request.param


def run_batch(
    shapes: list[tuple[int, int]], dtype: torch.dtype = torch.float32
) -> tuple[torch.Tensor, torch.Tensor]:
    """(paged, reference) outputs for sequences given as (cached prefix, new tokens)."""
    b = make_batch(shapes, heads=HEADS, kv_heads=KV_HEADS, head_dim=DIM, block_size=BLOCK_SIZE,
                   dtype=dtype)
    out = paged_attention(b.query, b.key_cache, b.value_cache, b.block_tables, b.seq_lens,
                          b.query_start_loc, b.seq_lens_host, b.scale)
    return out, b.reference


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
