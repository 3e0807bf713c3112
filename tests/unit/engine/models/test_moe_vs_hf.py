"""Mixture-of-experts families against transformers on the same random weights.

The same checks as test_model_vs_hf (logits of a mixed batch with a chunked prefill and
a decode, then 32 greedy tokens of four batched requests) on tiny Mixtral, Qwen2-MoE
(with its shared expert, and dense layers among the sparse ones) and Qwen3-MoE
checkpoints, plus how their configs are read.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import MixtralConfig, PreTrainedModel, Qwen2MoeConfig, Qwen3MoeConfig

from services.engine.models.loader import model_class
from services.engine.models.moe import SparseMoeBlock
from services.engine.worker.model_runner import ModelRunner
from tests.unit.engine.hf_checkpoints import (
    PROMPT_LENGTHS,
    VOCAB,
    check_mixed_batch,
    hf_greedy,
    make_checkpoint,
)
from tests.unit.engine.runner_driver import generate, make_runner, random_prompts

# Every checkpoint: hidden 64, 2 layers, top-2 routing.
VARIANTS: dict[str, tuple[str, dict[str, Any]]] = {
    "mixtral": ("mixtral", {"num_local_experts": 8, "intermediate_size": 48}),
    # Layer 1 dense (mlp_only_layers); the top-2 weights left unnormalized.
    "qwen2_moe-shared-expert": ("qwen2_moe", {
        "num_experts": 8, "moe_intermediate_size": 32, "shared_expert_intermediate_size": 48,
        "intermediate_size": 96, "mlp_only_layers": [1], "norm_topk_prob": False,
    }),
    # decoder_sparse_step 2: only layer 1 is sparse.
    "qwen2_moe-sparse-step-normed": ("qwen2_moe", {
        "num_experts": 4, "moe_intermediate_size": 32, "shared_expert_intermediate_size": 40,
        "intermediate_size": 80, "decoder_sparse_step": 2, "norm_topk_prob": True,
        "tie_word_embeddings": True,
    }),
    "qwen3_moe": ("qwen3_moe", {
        "num_experts": 8, "moe_intermediate_size": 32, "head_dim": 32, "norm_topk_prob": True,
    }),
    # An 8-token window in layer 0 only (transformers' Qwen2-MoE layer rule), prompts of
    # up to 22 tokens.
    "qwen2_moe-windowed": ("qwen2_moe", {
        "num_experts": 4, "moe_intermediate_size": 32, "shared_expert_intermediate_size": 48,
        "use_sliding_window": True, "sliding_window": 8, "max_window_layers": 2,
    }),
}

SMALL = {"vocab_size": VOCAB, "hidden_size": 64, "intermediate_size": 96,
         "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2,
         "max_position_embeddings": 128, "num_experts_per_tok": 2}


@pytest.fixture(scope="module", params=list(VARIANTS))
def pair(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> tuple[PreTrainedModel, ModelRunner]:
    family, overrides = VARIANTS[request.param]
    folder = tmp_path_factory.mktemp(request.param)
    hf = make_checkpoint(folder, family, num_experts_per_tok=2, **overrides)
    return hf, make_runner(folder)


def test_logits_match_for_a_mixed_batch(
    pair: tuple[PreTrainedModel, ModelRunner], monkeypatch: pytest.MonkeyPatch
) -> None:
    hf, runner = pair
    blocks = [m for m in runner.model.modules() if isinstance(m, SparseMoeBlock)]
    assert blocks
    chosen: set[int] = set()
    for block in blocks:
        # The decoder calls .forward directly, which skips nn.Module hooks; wrap it instead.
        def spy(x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor,
                run: Any = block.experts.forward) -> torch.Tensor:
            chosen.update(ids.flatten().tolist())
            return run(x, weights, ids)

        monkeypatch.setattr(block.experts, "forward", spy)
    check_mixed_batch(hf, runner, atol=1e-4, rtol=1e-4)
    # A wrong expert id would go unnoticed if the router sent every token to the same two.
    assert len(chosen) == blocks[0].gate.out_features


def test_greedy_tokens_match_generate(pair: tuple[PreTrainedModel, ModelRunner]) -> None:
    hf, runner = pair
    ps = random_prompts(PROMPT_LENGTHS, VOCAB)
    ours = generate(runner, ps, num_tokens=32, first_chunk={"d": 10, "b": 4})
    for rid, p in ps.items():
        assert ours[rid] == hf_greedy(hf, p, 32), rid


def test_bfloat16_checkpoint_matches_in_bfloat16(tmp_path: Path) -> None:
    family, overrides = VARIANTS["qwen2_moe-shared-expert"]
    hf = make_checkpoint(tmp_path, family, dtype=torch.bfloat16, num_experts_per_tok=2,
                         **overrides)
    runner = make_runner(tmp_path, dtype="auto")
    assert runner.model.model.layers[0].mlp.experts.w13.dtype == torch.bfloat16
    # As in test_model_vs_hf: bf16 rounding at different points, far below a real error.
    check_mixed_batch(hf, runner, atol=0.15, rtol=0.02)


def read(hf_config: Any) -> Any:
    arch = type(hf_config).__name__.replace("Config", "ForCausalLM")
    return model_class([arch]).config_from_hf(hf_config.to_dict())


def test_moe_switches_are_read_per_family() -> None:
    mixtral = read(MixtralConfig(**SMALL, num_local_experts=4)).moe
    assert (mixtral.num_experts, mixtral.intermediate_size, mixtral.norm_topk_prob) == (4, 96, True)
    assert (mixtral.sparse_layers, mixtral.shared_expert_intermediate_size) == ((0, 1, 2, 3), 0)

    qwen2 = read(Qwen2MoeConfig(**SMALL, num_experts=6, moe_intermediate_size=16,
                                shared_expert_intermediate_size=24, decoder_sparse_step=2,
                                mlp_only_layers=[3]))
    assert qwen2.qkv_bias and not qwen2.o_bias and qwen2.sliding_window is None
    assert qwen2.moe.sparse_layers == (1,)
    assert (qwen2.moe.num_experts, qwen2.moe.intermediate_size) == (6, 16)
    assert (qwen2.moe.norm_topk_prob, qwen2.moe.shared_expert_intermediate_size) == (False, 24)

    windowed = Qwen2MoeConfig(**SMALL, num_experts=4, use_sliding_window=True,
                              sliding_window=8, max_window_layers=3).to_dict()
    assert windowed["layer_types"][:3] == [
        "sliding_attention", "full_attention", "sliding_attention"]
    # The same layers from the rule, for configs written before `layer_types`.
    for hf in (windowed, {k: v for k, v in windowed.items() if k != "layer_types"}):
        config = model_class(["Qwen2MoeForCausalLM"]).config_from_hf(hf)
        assert (config.sliding_window, config.sliding_layers) == (8, (0, 2))

    qwen3 = read(Qwen3MoeConfig(**SMALL, num_experts=8, moe_intermediate_size=16,
                                norm_topk_prob=True, mlp_only_layers=[0]))
    assert qwen3.qk_norm and qwen3.moe.sparse_layers == (1, 2, 3)
    assert (qwen3.moe.num_experts, qwen3.moe.norm_topk_prob) == (8, True)
    assert qwen3.moe.shared_expert_intermediate_size == 0
    qwen3_windowed = read(Qwen3MoeConfig(**SMALL, num_experts=8, use_sliding_window=True,
                                         sliding_window=8, max_window_layers=2))
    assert (qwen3_windowed.sliding_window, qwen3_windowed.sliding_layers) == (8, None)


def test_a_checkpoint_missing_an_expert_is_refused(tmp_path: Path) -> None:
    make_checkpoint(tmp_path, "qwen3_moe", num_experts=4, moe_intermediate_size=32,
                    num_experts_per_tok=2)
    path = tmp_path / "model.safetensors"
    tensors = load_file(path)
    del tensors["model.layers.0.mlp.experts.3.up_proj.weight"]
    save_file(tensors, path)
    with pytest.raises(ValueError, match=r"missing .*layers\.0\.mlp\.experts\.w13"):
        make_runner(tmp_path)


def test_top_k_beyond_the_experts_is_a_clear_error(tmp_path: Path) -> None:
    make_checkpoint(tmp_path, "mixtral", num_local_experts=4, intermediate_size=32,
                    num_experts_per_tok=2)
    config = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, "num_experts_per_tok": 5}))
    with pytest.raises(ValueError, match=r"num_experts_per_tok must be in \[1, num_experts 4\]"):
        make_runner(tmp_path)
