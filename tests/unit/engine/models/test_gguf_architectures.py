"""Every family the GGUF reader serves, on tiny random models written as GGUF files.

SmolLM2 (the one real file the tests have) covers dense Llama. Here each other family is
written by tests/gguf_writer.py as llama.cpp's converter would write it (F32, so the
weights are exact), read back by transformers' GGUF loader where it knows the family
(which checks the writer against a reader that is not ours), then served from the file:
its logits for a mixed batch with a chunked prefill must equal those of the transformers
model that was written, and a Q8_0 copy of the file (linear layers served on its blocks)
must give the greedy tokens of the same model with its weights rounded by gguf's Q8_0.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from gguf import GGMLQuantizationType, GGUFReader
from transformers import AutoModelForCausalLM, LlamaConfig, PreTrainedModel
from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

from services.common.gguf_checkpoint import ensure_gguf_view
from services.engine.models.linear import Linear, QuantizedLinear
from services.engine.models.moe import QuantizedExperts, StackedExperts
from services.engine.models.rotary_embedding import inverse_frequencies
from tests.gguf_writer import rounded_weights, write_gguf
from tests.unit.engine.hf_checkpoints import (
    PROMPT_LENGTHS,
    VOCAB,
    check_mixed_batch,
    hf_greedy,
    make_checkpoint,
)
from tests.unit.engine.runner_driver import generate, make_runner, random_prompts

LLAMA31_ROPE = {"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0,
                "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                # Short, so that the 16-wide heads have pairs on both sides of the band.
                "original_max_position_embeddings": 32}
MOE = {"num_experts_per_tok": 2}
# family, overrides; every layer sparse in the MoE ones (llama.cpp has no dense layers
# among sparse ones for these architectures).
VARIANTS: dict[str, tuple[str, dict[str, Any]]] = {
    "llama": ("llama", {}),
    "llama3.1-rope-freqs": ("llama", {"rope_parameters": LLAMA31_ROPE}),
    "mistral": ("mistral", {}),
    "qwen2": ("qwen2", {}),
    "qwen3": ("qwen3", {"head_dim": 32}),
    "mixtral": ("mixtral", {**MOE, "num_local_experts": 4}),
    "qwen2_moe": ("qwen2_moe", {**MOE, "num_experts": 4, "moe_intermediate_size": 32,
                                "shared_expert_intermediate_size": 48}),
    "qwen3_moe": ("qwen3_moe", {**MOE, "num_experts": 4, "moe_intermediate_size": 32,
                                "head_dim": 32, "norm_topk_prob": True}),
}
# transformers reads a Mistral file (architecture llama) only into a Llama model, and
# has no reader for Mixtral's (llama with experts).
READ_AS_LLAMA = {"mistral"}
NOT_READ_BY_TRANSFORMERS = {"mixtral"}


@pytest.fixture(scope="module", params=list(VARIANTS))
def written(request: pytest.FixtureRequest,
            tmp_path_factory: pytest.TempPathFactory) -> tuple[str, PreTrainedModel, Path]:
    family, overrides = VARIANTS[request.param]
    folder = tmp_path_factory.mktemp(request.param)
    hf = make_checkpoint(folder / "hf", family, **overrides)
    return request.param, hf, write_gguf(hf, folder / f"{request.param}.gguf")


def serve(file: Path, cache: Path) -> Any:
    # A float32 cache (auto gives a GGUF file float16's): these tests check how the file's
    # tensors are read, to float32 rounding.
    return make_runner(ensure_gguf_view(file, cache), kv_cache_dtype="float32")


def test_transformers_reads_the_written_weights_back(
    written: tuple[str, PreTrainedModel, Path]
) -> None:
    variant, hf, file = written
    if variant in NOT_READ_BY_TRANSFORMERS:
        pytest.skip(f"transformers {variant}: no GGUF reader for it (the expert stacking "
                    "is the Qwen MoE files' and the q/k permutation Llama's, both checked)")
    target = hf
    if variant in READ_AS_LLAMA:
        settings = {k: v for k, v in hf.config.to_dict().items() if k != "model_type"}
        target = AutoModelForCausalLM.from_config(LlamaConfig(**settings))
    tensors = load_gguf_checkpoint(str(file), return_tensors=True, model_to_load=target,
                                   torch_dtype=torch.float32)["tensors"]
    expected = hf.state_dict()
    assert sorted(tensors) == sorted(expected)
    for name, values in expected.items():
        assert torch.equal(tensors[name], values), name


def test_served_logits_equal_the_written_model(
    written: tuple[str, PreTrainedModel, Path], tmp_path: Path
) -> None:
    _, hf, file = written
    check_mixed_batch(hf, serve(file, tmp_path), atol=1e-4, rtol=1e-4)


def test_rope_freqs_are_read_as_the_llama3_scaling_they_came_from(tmp_path: Path) -> None:
    hf = make_checkpoint(tmp_path / "hf", "llama", rope_parameters=LLAMA31_ROPE)
    file = write_gguf(hf, tmp_path / "llama31.gguf")
    runner = serve(file, tmp_path / "cache")
    rotary = runner.model.model.rotary_emb
    want, _ = inverse_frequencies(16, 10000.0, LLAMA31_ROPE, 128)
    torch.testing.assert_close(rotary.inv_freq, want, rtol=1e-6, atol=0)
    # The scaling matters here: without it the frequencies differ.
    plain, _ = inverse_frequencies(16, 10000.0, {}, 128)
    assert not torch.allclose(want, plain)


@pytest.mark.parametrize("variant", ["llama3.1-rope-freqs", "qwen3", "mixtral", "qwen2_moe",
                                     "qwen3_moe"])
def test_q8_0_file_gives_the_greedy_tokens_of_its_rounded_weights(
    variant: str, tmp_path: Path
) -> None:
    family, overrides = VARIANTS[variant]
    hf = make_checkpoint(tmp_path / "hf", family, **overrides)
    file = write_gguf(hf, tmp_path / f"{variant}.gguf", GGMLQuantizationType.Q8_0)
    assert {t.tensor_type for t in GGUFReader(file).tensors} >= {GGMLQuantizationType.Q8_0}
    rounded = AutoModelForCausalLM.from_config(hf.config).eval()
    rounded.load_state_dict(rounded_weights(hf, GGMLQuantizationType.Q8_0))
    runner = serve(file, tmp_path / "cache")
    assert any(isinstance(m, QuantizedLinear) for m in runner.model.modules())
    for experts in [m for m in runner.model.modules() if isinstance(m, StackedExperts)]:
        pytest.fail(f"experts dequantized: {experts}")
    for experts in [m for m in runner.model.modules() if isinstance(m, QuantizedExperts)]:
        # Mixtral's down projections have rows of 172 values, not whole blocks: F32.
        assert all(isinstance(m, QuantizedLinear) for m in experts.w13)
        assert all(isinstance(m, QuantizedLinear if variant != "mixtral" else Linear)
                   for m in experts.w2)
    prompts = random_prompts(PROMPT_LENGTHS, VOCAB)
    ours = generate(runner, prompts, num_tokens=16, first_chunk={"d": 10})
    for rid, prompt in prompts.items():
        assert ours[rid] == hf_greedy(rounded, prompt, 16), rid


def test_a_quantized_moe_file_is_held_in_about_its_own_size(tmp_path: Path) -> None:
    # Experts are most of its bytes (here about 70%): dequantized, they alone would
    # make the weights 3x the file.
    hf = make_checkpoint(tmp_path / "hf", "qwen3_moe", num_experts=8, num_experts_per_tok=2,
                         moe_intermediate_size=64, head_dim=32, hidden_size=128)
    file = write_gguf(hf, tmp_path / "moe.gguf", GGMLQuantizationType.Q8_0)
    model = serve(file, tmp_path / "cache").model
    held = {t.data_ptr(): t.numel() * t.element_size()
            for t in [*model.parameters(), *model.buffers()]}
    assert sum(held.values()) <= 1.3 * file.stat().st_size
