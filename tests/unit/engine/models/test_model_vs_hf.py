"""Every supported family over the paged cache against transformers on the same weights.

Each variant is a tiny random checkpoint written by transformers; we load it through
ModelRunner and compare logits of a mixed batch (whole prompts, a chunked prefill,
a decode) and 32 greedy tokens of four requests batched in one execute per step.
Variants with a sliding window use prompts several windows long, so that the window
binds in prefills, in the chunk after a cached prefix and in every decode.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaForCausalLM, PreTrainedModel

from services.common.tiny_checkpoint import ensure_tiny_checkpoint
from services.engine.scheduler.output import RunnerOutput, SchedulerOutput
from services.engine.worker.config import RunnerConfig
from services.engine.worker.model_runner import ModelRunner
from tests.unit.engine.hf_checkpoints import (
    PROMPT_LENGTHS,
    VOCAB,
    check_mixed_batch,
    hf_greedy,
    hf_logits,
    make_checkpoint,
)
from tests.unit.engine.runner_driver import (
    generate,
    make_runner,
    random_prompts,
)

# With a window of 8: prompts of 2.5 to 5 windows, plus one shorter than the window.
WINDOWED_PROMPT_LENGTHS = {"a": 20, "b": 33, "c": 5, "d": 40}

# name -> (family, config overrides)
VARIANTS: dict[str, tuple[str, dict[str, Any]]] = {
    "llama": ("llama", {}),
    "llama-tied": ("llama", {"tie_word_embeddings": True}),
    "llama-llama3-rope": ("llama", {"rope_scaling": {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 16,
    }}),
    # A window as long as max_model_len never binds, so it is accepted.
    "mistral-linear-rope": ("mistral", {
        "sliding_window": 128,
        "rope_scaling": {"rope_type": "linear", "factor": 2.0},
    }),
    "qwen2": ("qwen2", {}),
    "qwen2-tied": ("qwen2", {"tie_word_embeddings": True}),
    # head_dim 32 with 4 heads: q is twice as wide as the hidden state.
    "qwen3": ("qwen3", {"head_dim": 32}),
    "qwen3-yarn-rope": ("qwen3", {"head_dim": 32, "rope_parameters": {
        "rope_type": "yarn",
        "rope_theta": 10000.0,
        "factor": 4.0,
        "original_max_position_embeddings": 32,
    }}),
}
# Sliding windows far shorter than the prompts plus 32 generated tokens.
WINDOWED_VARIANTS: dict[str, tuple[str, dict[str, Any]]] = {
    "mistral-window-8": ("mistral", {"sliding_window": 8}),
    # Layer 0 attends over everything, layer 1 through the window (max_window_layers).
    "qwen2-window-8-layer-1": ("qwen2", {
        "use_sliding_window": True, "sliding_window": 8, "max_window_layers": 1,
    }),
    # The other way round, named by layer_types.
    "qwen3-window-8-layer-0": ("qwen3", {
        "head_dim": 32, "use_sliding_window": True, "sliding_window": 8,
        "layer_types": ["sliding_attention", "full_attention"],
    }),
}
# What turns a windowed variant's window off, for the check that the reference slides.
NO_WINDOW: dict[str, dict[str, Any]] = {
    "mistral": {"sliding_window": None},
    "qwen2": {"use_sliding_window": False, "layer_types": ["full_attention"] * 2},
    "qwen3": {"use_sliding_window": False, "layer_types": ["full_attention"] * 2},
}


Pair = tuple[PreTrainedModel, ModelRunner, dict[str, int]]


@pytest.fixture(scope="module", params=[*VARIANTS, *WINDOWED_VARIANTS])
def pair(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Pair:
    """(reference, our runner, prompt lengths) of one variant."""
    windowed = request.param in WINDOWED_VARIANTS
    family, overrides = (WINDOWED_VARIANTS if windowed else VARIANTS)[request.param]
    folder = tmp_path_factory.mktemp(request.param)
    hf = make_checkpoint(folder, family, **overrides)
    return hf, make_runner(folder), WINDOWED_PROMPT_LENGTHS if windowed else PROMPT_LENGTHS


def test_logits_match_for_a_mixed_batch(pair: Pair) -> None:
    hf, runner, lengths = pair
    check_mixed_batch(hf, runner, atol=1e-4, rtol=1e-4, lengths=lengths)


def test_greedy_tokens_match_generate(pair: Pair) -> None:
    hf, runner, lengths = pair
    ps = random_prompts(lengths, VOCAB)
    ours = generate(runner, ps, num_tokens=32, first_chunk={"d": 10, "b": 4})
    for rid, p in ps.items():
        assert ours[rid] == hf_greedy(hf, p, 32), rid


@pytest.mark.parametrize("variant", list(WINDOWED_VARIANTS))
def test_windowed_reference_differs_from_full_attention(variant: str, tmp_path: Path) -> None:
    # Otherwise the windowed variants above could pass with the window ignored on both
    # sides (say, a transformers attention backend that drops it).
    family, overrides = WINDOWED_VARIANTS[variant]
    windowed = make_checkpoint(tmp_path, family, **overrides)
    full = AutoModelForCausalLM.from_pretrained(tmp_path, **NO_WINDOW[family]).eval()
    prompt = random_prompts({"p": 40}, VOCAB)["p"]
    want, unwindowed = hf_logits(windowed, prompt), hf_logits(full, prompt)
    # The first 8 positions see no further back than the window: identical there.
    torch.testing.assert_close(want[:8], unwindowed[:8], atol=1e-5, rtol=1e-5)
    assert (want[8:] - unwindowed[8:]).abs().amax(dim=-1).min() > 1e-3
    assert hf_greedy(windowed, prompt, 32) != hf_greedy(full, prompt, 32)


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_bfloat16_checkpoint_matches_in_bfloat16(family: str, tmp_path: Path) -> None:
    overrides = {"head_dim": 32} if family == "qwen3" else {}
    hf = make_checkpoint(tmp_path, family, dtype=torch.bfloat16, **overrides)
    runner = make_runner(tmp_path, dtype="auto")
    assert runner.dtype == "bfloat16" and runner.kv_caches[0].dtype == torch.bfloat16
    # Logits here reach about 5, where one bf16 step is 0.03; the two sides round at
    # different points (our RoPE runs in float32, transformers' in bf16), which costs
    # a few steps. A wrong weight or a missing norm is off by far more.
    check_mixed_batch(hf, runner, atol=0.15, rtol=0.02)


def test_tiny_checkpoint_matches_transformers(tmp_path: Path) -> None:
    folder = ensure_tiny_checkpoint(tmp_path)
    hf = LlamaForCausalLM.from_pretrained(folder).eval()
    runner = ModelRunner(RunnerConfig(model=str(folder), device="cpu", kv_cache_memory=8 << 20,
                                      max_model_len=256))
    ps = random_prompts({"x": 3, "y": 17, "z": 40}, vocab=runner.model_info.vocab_size)
    ours = generate(runner, ps, num_tokens=32, first_chunk={"z": 20})
    for rid, p in ps.items():
        assert ours[rid] == hf_greedy(hf, p, 32), rid


def test_tiny_checkpoint_is_the_default_model(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("CORESTREAM_CACHE_DIR", str(tmp_path))
    runner = ModelRunner(RunnerConfig(kv_cache_memory=1 << 20, max_model_len=64))
    assert runner.model_info.name == "tiny-llama-v2"
    assert runner.model_info.max_model_len == 64
    assert (runner.device, runner.dtype, runner.block_size) == ("cpu", "float32", 16)
    assert runner.num_blocks == (1 << 20) // (2 * 2 * 16 * 2 * 16 * 4)
    runner.warmup()
    assert runner.execute(SchedulerOutput([])) == RunnerOutput()


def test_too_little_kv_cache_memory_is_a_clear_error(tmp_path: Path) -> None:
    folder = ensure_tiny_checkpoint(tmp_path)
    with pytest.raises(ValueError, match="kv_cache_memory"):
        ModelRunner(RunnerConfig(model=str(folder), kv_cache_memory=1 << 16))


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_half_precision_runs_on_cpu(dtype: str, tmp_path: Path) -> None:
    folder = ensure_tiny_checkpoint(tmp_path)
    runner = ModelRunner(RunnerConfig(model=str(folder), dtype=dtype, device="cpu",
                                      kv_cache_memory=1 << 20, max_model_len=64))
    assert runner.dtype == dtype and runner.kv_caches[0].dtype == getattr(torch, dtype)
    out = generate(runner, {"r": [1, 5, 9, 14]}, num_tokens=4)
    assert len(out["r"]) == 4 and all(0 <= t < runner.model_info.vocab_size for t in out["r"])
