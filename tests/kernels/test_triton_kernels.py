"""Triton kernels against the dense torch reference.

Without CUDA these run in Triton's interpreter (TRITON_INTERPRET=1) on CPU tensors at
tiny shapes; with CUDA the same tests run compiled, and the `gpu` ones add realistic sizes.
They skip when triton is not installed (it is in the `gpu` extra, not `dev`).
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
if DEVICE == "cpu":
    # NOTE: triton reads this when a kernel is decorated, so it must precede the first
    # import of corestream_kernels.triton_*.
    os.environ.setdefault("TRITON_INTERPRET", "1")

pytest.importorskip("triton")

from corestream_kernels.paged_attention import paged_attention  # noqa: E402
from corestream_kernels.triton_kv_cache import write_kv_cache_triton  # noqa: E402
from corestream_kernels.triton_paged_attention import paged_attention_triton  # noqa: E402

from tests.kernels.paged_batch import PagedBatch, make_batch  # noqa: E402

# fp32 dots run as tf32 on GPUs; the interpreter computes them exactly.
TOLERANCE = {torch.float32: 1e-2 if DEVICE == "cuda" else 1e-4, torch.bfloat16: 3e-2}


def run_triton(batch: PagedBatch) -> torch.Tensor:
    starts = batch.query_start_loc_host
    return paged_attention_triton(
        batch.query,
        batch.key_cache,
        batch.value_cache,
        batch.block_tables,
        batch.seq_lens,
        batch.query_start_loc,
        max(b - a for a, b in zip(starts, starts[1:], strict=False)),
        batch.scale,
        batch.sliding_window,
    )


def check(batch: PagedBatch, dtype: torch.dtype) -> None:
    out = run_triton(batch)
    assert out.dtype == dtype and out.shape == batch.query.shape
    tol = TOLERANCE[dtype]
    torch.testing.assert_close(out.float(), batch.reference, atol=tol, rtol=tol)


BATCHES = {
    "decode": [(5, 1), (12, 1), (0, 1), (30, 1)],
    "prefill": [(0, 7), (0, 20)],
    "chunk_after_prefix": [(9, 5), (17, 20)],
    "mixed": [(0, 6), (10, 1), (4, 8), (7, 1), (0, 1), (33, 3)],
}


@pytest.mark.parametrize("kind", BATCHES)
@pytest.mark.parametrize(("heads", "kv_heads"), [(2, 2), (8, 2)], ids=["gqa1", "gqa4"])
def test_attention_tiny(kind: str, heads: int, kv_heads: int) -> None:
    # NaN in every unwritten slot: masked keys and values must never reach the output.
    batch = make_batch(
        BATCHES[kind],
        heads=heads,
        kv_heads=kv_heads,
        head_dim=16,
        block_size=16,
        device=DEVICE,
        fill=float("nan"),
    )
    check(batch, torch.float32)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_attention_bf16_and_odd_head_dim(dtype: torch.dtype) -> None:
    batch = make_batch(
        BATCHES["mixed"],
        heads=6,
        kv_heads=2,
        head_dim=24,
        block_size=16,
        dtype=dtype,
        device=DEVICE,
    )
    check(batch, dtype)


@pytest.mark.parametrize("kind", ["decode", "chunk_after_prefix", "mixed"])
@pytest.mark.parametrize("window", [1, 5, 16, 21])
def test_attention_sliding_window_tiny(kind: str, window: int) -> None:
    # Windows inside a block, on its edge and across blocks; with BLOCK_Q query rows per
    # program, rows of one program start their windows in different blocks.
    batch = make_batch(
        BATCHES[kind],
        heads=8,
        kv_heads=2,
        head_dim=16,
        block_size=16,
        device=DEVICE,
        fill=float("nan"),
        sliding_window=window,
    )
    check(batch, torch.float32)


def test_attention_rejects_small_blocks() -> None:
    batch = make_batch([(3, 1)], heads=2, kv_heads=2, head_dim=16, block_size=8, device=DEVICE)
    with pytest.raises(ValueError, match="block_size"):
        run_triton(batch)


@pytest.mark.parametrize(
    ("dtype", "cache_dtype"),
    [
        (torch.float32, torch.float32),
        (torch.bfloat16, torch.bfloat16),
        (torch.float32, torch.bfloat16),  # the cache may be narrower than the model
    ],
)
def test_write_kv_cache(dtype: torch.dtype, cache_dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(0)
    key_cache = torch.zeros(6, 16, 2, 24, dtype=cache_dtype)
    value_cache = torch.zeros_like(key_cache)
    # A strided view, as when keys are sliced out of a fused projection.
    key = torch.randn(5, 3, 2, 24, generator=gen).to(dtype)[:, 1]
    value = torch.randn(5, 2, 24, generator=gen).to(dtype)
    slots = torch.tensor([0, 17, 40, 95, 33])
    expected_keys, expected_values = key_cache.clone(), value_cache.clone()
    expected_keys.view(-1, 2, 24)[slots] = key.to(cache_dtype)
    expected_values.view(-1, 2, 24)[slots] = value.to(cache_dtype)

    key_cache, value_cache = key_cache.to(DEVICE), value_cache.to(DEVICE)
    write_kv_cache_triton(
        key.to(DEVICE), value.to(DEVICE), key_cache, value_cache, slots.to(DEVICE)
    )
    # A cast may round differently: the interpreter truncates fp32 to bf16, GPUs round.
    tol = 0 if dtype == cache_dtype else 2**-7
    torch.testing.assert_close(key_cache.cpu(), expected_keys, atol=tol, rtol=tol)
    torch.testing.assert_close(value_cache.cpu(), expected_values, atol=tol, rtol=tol)


@pytest.mark.gpu
@pytest.mark.parametrize("window", [None, 200])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    ("heads", "kv_heads", "head_dim"), [(32, 32, 128), (32, 8, 128), (16, 4, 80)]
)
def test_attention_realistic(
    dtype: torch.dtype, heads: int, kv_heads: int, head_dim: int, window: int | None
) -> None:
    gen = torch.Generator().manual_seed(1)
    decodes = [(int(n), 1) for n in torch.randint(1, 1000, (96,), generator=gen)]
    prefills = [(0, 300), (0, 17), (512, 128), (95, 33), (1000, 1)]
    batch = make_batch(
        prefills + decodes,
        heads=heads,
        kv_heads=kv_heads,
        head_dim=head_dim,
        block_size=16,
        dtype=dtype,
        device=DEVICE,
        fill=float("nan"),
        sliding_window=window,
    )
    check(batch, dtype)


@pytest.mark.gpu
@pytest.mark.parametrize("window", [None, 37])
def test_dispatch_on_cuda_matches_torch(window: int | None) -> None:
    from corestream_kernels.backend import force_torch

    batch = make_batch(
        [(0, 200), (300, 1), (40, 60), (700, 1)],
        heads=32,
        kv_heads=8,
        head_dim=128,
        block_size=16,
        dtype=torch.bfloat16,
        device=DEVICE,
        sliding_window=window,
    )
    args = batch.args()
    triton_out = paged_attention(*args)
    force_torch(True)
    try:
        torch_out = paged_attention(*args)
    finally:
        force_torch(False)
    torch.testing.assert_close(triton_out.float(), torch_out.float(), atol=3e-2, rtol=3e-2)


def test_model_layers_share_the_runners_query_offsets(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A windowed model through the Triton kernels, against transformers: every layer
    reads the offsets the runner copied once for the step, instead of copying its own."""
    import corestream_kernels.kv_cache as kv_cache_module
    import corestream_kernels.paged_attention as paged_attention_module
    import corestream_kernels.triton_paged_attention as triton_module

    from services.engine.scheduler.output import ScheduledRequest
    from services.engine.worker.config import RunnerConfig
    from services.engine.worker.model_runner import ModelRunner
    from tests.unit.engine.hf_checkpoints import VOCAB, hf_logits, make_checkpoint
    from tests.unit.engine.runner_driver import GREEDY, random_prompts

    if DEVICE == "cpu":  # the interpreter stands in for CUDA
        monkeypatch.setattr(paged_attention_module, "use_triton", lambda tensor: True)
        monkeypatch.setattr(kv_cache_module, "use_triton", lambda tensor: True)
    offsets: list[torch.Tensor] = []
    kernel = triton_module.paged_attention_triton

    def recording_kernel(*args: object) -> torch.Tensor:
        offsets.append(args[5])  # type: ignore[arg-type]
        return kernel(*args)  # type: ignore[arg-type]

    monkeypatch.setattr(triton_module, "paged_attention_triton", recording_kernel)
    hf = make_checkpoint(tmp_path, "mistral", sliding_window=8)
    runner = ModelRunner(RunnerConfig(model=str(tmp_path), device=DEVICE, block_size=16,
                                      kv_cache_memory=1 << 20, max_model_len=64))
    ps = random_prompts({"a": 20, "d": 30}, VOCAB)
    split, extra = 9, 77

    def step(requests: list[ScheduledRequest]) -> torch.Tensor:
        offsets.clear()
        with torch.inference_mode():
            batch = runner._prepare(requests)
            hidden = runner.model(batch.input_ids, batch.positions, batch.meta, runner.kv_caches)
        assert len(offsets) == 2 and all(t is batch.meta.query_start_loc for t in offsets)
        return runner.model.compute_logits(hidden).cpu()

    got1 = step([
        ScheduledRequest("a", ps["a"], 0, [0, 1], True, GREEDY, ps["a"], []),
        ScheduledRequest("d", ps["d"][:split], 0, [2], True, GREEDY, ps["d"], []),
    ])
    got2 = step([
        ScheduledRequest("a", [extra], 20, [0, 1], True, GREEDY, ps["a"], []),
        ScheduledRequest("d", ps["d"][split:], split, [2, 3], True, GREEDY, ps["d"], []),
    ])
    tol = TOLERANCE[torch.float32]
    want_a, want_d = hf_logits(hf, ps["a"] + [extra]), hf_logits(hf, ps["d"])
    torch.testing.assert_close(got1[:20], want_a[:20], atol=tol, rtol=tol)
    torch.testing.assert_close(got1[20:], want_d[:split], atol=tol, rtol=tol)
    torch.testing.assert_close(got2[0], want_a[20], atol=tol, rtol=tol)
    torch.testing.assert_close(got2[1:], want_d[split:], atol=tol, rtol=tol)
