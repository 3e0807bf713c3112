"""The engine on a CUDA device: what CI, which has no GPU, never runs.

The same checks as the CPU suite, on the device: our logits against transformers' on
the same weights and identical greedy tokens (float32, where the Triton kernels must
match the torch reference), float16 and bfloat16 checkpoints within half-precision
tolerance, and the engine core's exactness properties (chunked prefill, preemption,
per-request seeds) with a CUDA runner. Run them on a GPU machine with
`scripts/gpu_check.sh`. `CORESTREAM_TEST_DEVICE=cpu` runs the same tests on the CPU,
which is how the tests themselves are checked on a machine without a GPU.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from corestream_kernels.backend import use_triton

from services.common.tiny_checkpoint import ensure_tiny_checkpoint
from services.engine.worker.config import RunnerConfig
from services.engine.worker.model_runner import ModelRunner
from tests.unit.engine.fakes import RecordingRunner, run_core, tokens, varied_requests
from tests.unit.engine.hf_checkpoints import (
    PROMPT_LENGTHS,
    VOCAB,
    check_mixed_batch,
    hf_greedy,
    make_checkpoint,
)
from tests.unit.engine.runner_driver import generate, make_runner, random_prompts

DEVICE = os.environ.get("CORESTREAM_TEST_DEVICE", "cuda")
pytestmark = [pytest.mark.gpu] if DEVICE == "cuda" else []

# family -> config overrides; one of each attention shape the models add.
FAMILIES = {
    "llama": ("llama", {}),
    "qwen2": ("qwen2", {}),
    "qwen3": ("qwen3", {"head_dim": 32}),
    "mistral-window-8": ("mistral", {"sliding_window": 8}),
}


@pytest.fixture(autouse=True)
def exact_float32_matmuls() -> None:
    # TF32 would round float32 matmul inputs to 10 mantissa bits: not the reference.
    if DEVICE == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = False


@pytest.mark.timeout(300)
@pytest.mark.parametrize("variant", list(FAMILIES))
def test_float32_matches_transformers(variant: str, tmp_path: Path) -> None:
    family, overrides = FAMILIES[variant]
    hf = make_checkpoint(tmp_path, family, **overrides)
    runner = make_runner(tmp_path, device=DEVICE)
    assert runner.device.startswith(DEVICE)
    if DEVICE == "cuda":
        assert use_triton(runner.kv_caches[0]), "the CUDA engine must run the Triton kernels"
    lengths = {"a": 20, "b": 33, "c": 5, "d": 40} if "window" in variant else PROMPT_LENGTHS
    check_mixed_batch(hf, runner, atol=1e-4, rtol=1e-4, lengths=lengths)
    prompts = random_prompts(lengths, VOCAB)
    ours = generate(runner, prompts, num_tokens=32, first_chunk={"d": 10, "b": 4})
    for rid, prompt in prompts.items():
        assert ours[rid] == hf_greedy(hf, prompt, 32), rid


@pytest.mark.timeout(300)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_half_precision_checkpoint_runs_in_its_dtype(dtype: torch.dtype, tmp_path: Path) -> None:
    if DEVICE == "cpu" and dtype == torch.float16:
        pytest.skip("float16 is a CUDA dtype here")
    # The reference runs on the CPU in the checkpoint's dtype.
    hf = make_checkpoint(tmp_path, "llama", dtype=dtype)
    runner = make_runner(tmp_path, dtype="auto", device=DEVICE)
    assert runner.kv_caches[0].dtype == dtype, "--dtype auto follows the checkpoint"
    # As in the CPU bfloat16 test: both sides round at different points, a few steps of
    # a half-precision number at logits of about 5; a wrong weight is off by far more.
    check_mixed_batch(hf, runner, atol=0.15, rtol=0.02)


@pytest.fixture(scope="module")
def device_runner() -> ModelRunner:
    runner = ModelRunner(RunnerConfig(model=str(ensure_tiny_checkpoint()), device=DEVICE,
                                      kv_cache_memory="8MiB"))
    runner.warmup()
    return runner


@pytest.mark.timeout(120)
def test_chunked_prefill_and_preemption_match_a_roomy_run(device_runner: ModelRunner) -> None:
    vocab = device_runner.model_info.vocab_size
    roomy, _ = run_core(device_runner, varied_requests(vocab), max_num_batched_tokens=2048)
    chunked, _ = run_core(device_runner, varied_requests(vocab), max_num_batched_tokens=16)
    tight = RecordingRunner(device_runner, num_blocks=6)
    squeezed, _ = run_core(tight, varied_requests(vocab))
    assert tight.num_preemptions > 0
    want = {k: tokens(v) for k, v in roomy.items()}
    assert {k: tokens(v) for k, v in chunked.items()} == want
    assert {k: tokens(v) for k, v in squeezed.items()} == want


@pytest.mark.timeout(120)
def test_seeded_requests_repeat_whatever_shares_the_batch(device_runner: ModelRunner) -> None:
    vocab = device_runner.model_info.vocab_size
    sampling = {"temperature": 0.9, "top_p": 0.9, "seed": 1234}
    alone, _ = run_core(device_runner, varied_requests(vocab, **sampling)[:1])
    batched, _ = run_core(device_runner, varied_requests(vocab, **sampling))
    tight = RecordingRunner(device_runner, num_blocks=6)
    squeezed, _ = run_core(tight, varied_requests(vocab, **sampling))
    assert tight.num_preemptions > 0
    assert tokens(batched["r0"]) == tokens(alone["r0"])
    assert {k: tokens(v) for k, v in squeezed.items()} == {
        k: tokens(v) for k, v in batched.items()
    }


@pytest.mark.timeout(60)
def test_zero_token_forward_and_empty_step(device_runner: ModelRunner) -> None:
    # An idle expert-parallel rank's dummy step: a forward over no tokens.
    device_runner.execute_dummy()
    prompts = random_prompts({"x": 9}, device_runner.model_info.vocab_size)
    first = generate(device_runner, prompts, num_tokens=4)
    device_runner.execute_dummy()
    assert generate(device_runner, prompts, num_tokens=4) == first
