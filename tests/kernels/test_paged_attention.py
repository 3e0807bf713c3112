from __future__ import annotations

import corestream_kernels.paged_attention as paged_attention_module
import pytest
import torch
from corestream_kernels.backend import set_backend
from corestream_kernels.paged_attention import paged_attention

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
    shapes: list[tuple[int, int]],
    dtype: torch.dtype = torch.float32,
    sliding_window: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(paged, reference) outputs for sequences given as (cached prefix, new tokens)."""
    b = make_batch(shapes, heads=HEADS, kv_heads=KV_HEADS, head_dim=DIM, block_size=BLOCK_SIZE,
                   dtype=dtype, sliding_window=sliding_window)
    return paged_attention(*b.args()), b.reference


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


SLIDING_SHAPES = [
    [(0, 13)],                          # a prompt longer than the window
    [(9, 5)],                           # a chunk whose window starts inside the prefix
    [(5, 1), (12, 1), (0, 1), (3, 1)],  # decodes only
    [(0, 6), (10, 1), (14, 8), (7, 1), (0, 1), (2, 3)],  # mixed
]


@pytest.mark.parametrize("shapes", SLIDING_SHAPES)
@pytest.mark.parametrize("window", [1, 3, 4, 6, 64])
def test_sliding_window_matches_dense_reference(
    shapes: list[tuple[int, int]], window: int
) -> None:
    out, ref = run_batch(shapes, sliding_window=window)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)


def test_sliding_window_changes_the_output() -> None:
    # The window test above could pass with the window ignored if it never bound.
    windowed, _ = run_batch([(0, 13), (10, 1)], sliding_window=4)
    full, _ = run_batch([(0, 13), (10, 1)])
    assert not torch.allclose(windowed[4:], full[4:], atol=1e-3)
    torch.testing.assert_close(windowed[:4], full[:4], atol=1e-5, rtol=1e-5)


def test_window_below_one_is_refused() -> None:
    with pytest.raises(ValueError, match="sliding_window must be >= 1, got 0"):
        run_batch([(3, 1)], sliding_window=0)
