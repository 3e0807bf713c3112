"""Tiny random checkpoints of every supported family, written by transformers itself.

The reference model is the one that wrote the checkpoint, so a test compares our
loader and decoder against transformers on identical weights (`check_mixed_batch`
compares the logits of a mixed batch).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from transformers import (
    AutoModelForCausalLM,
    GenerationConfig,
    LlamaConfig,
    MistralConfig,
    MixtralConfig,
    PretrainedConfig,
    PreTrainedModel,
    Qwen2Config,
    Qwen2MoeConfig,
    Qwen3Config,
    Qwen3MoeConfig,
)

from services.engine.scheduler.output import ScheduledRequest
from services.engine.worker.model_runner import ModelRunner
from tests.unit.engine.runner_driver import GREEDY, all_logits, random_prompts

VOCAB = 256

CONFIG_CLASSES: dict[str, type[PretrainedConfig]] = {
    "llama": LlamaConfig,
    "mistral": MistralConfig,
    "qwen2": Qwen2Config,
    "qwen3": Qwen3Config,
    "mixtral": MixtralConfig,
    "qwen2_moe": Qwen2MoeConfig,
    "qwen3_moe": Qwen3MoeConfig,
}


def make_checkpoint(
    folder: Path, family: str, dtype: torch.dtype = torch.float32, **overrides: Any
) -> PreTrainedModel:
    """Save a 2-layer random `family` model into `folder`; return it in eval mode."""
    torch.manual_seed(0)
    arch: dict[str, Any] = {
        "vocab_size": VOCAB,
        "hidden_size": 64,
        "intermediate_size": 172,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 128,
        # Wider than the default 0.02 so that attention, not just embeddings, decides.
        "initializer_range": 0.15,
    }
    config = CONFIG_CLASSES[family](**{**arch, **overrides})
    model = randomize_norms(AutoModelForCausalLM.from_config(config))
    model = model.to(dtype).eval()
    model.save_pretrained(folder)
    return model


def randomize_norms(model: PreTrainedModel) -> PreTrainedModel:
    """transformers starts norms at 1 and biases at 0, which would hide a weight that
    fails to load; make them random too."""
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.uniform_(0.5, 1.5)
            elif name.endswith(".bias"):
                param.normal_(0.0, 0.1)
    return model


def hf_greedy(model: PreTrainedModel, prompt: list[int], num_tokens: int) -> list[int]:
    ids = torch.tensor([prompt])
    # eos_token_id=[]: never stop early.
    config = GenerationConfig(
        do_sample=False, max_new_tokens=num_tokens, eos_token_id=[], pad_token_id=0
    )
    out = model.generate(ids, attention_mask=torch.ones_like(ids), generation_config=config)
    assert out.shape[1] == len(prompt) + num_tokens
    return out[0, len(prompt):].tolist()


def hf_logits(model: PreTrainedModel, prompt: list[int]) -> torch.Tensor:
    """float32 logits `[len(prompt), vocab]`."""
    with torch.no_grad():
        return model(torch.tensor([prompt])).logits[0].float()


PROMPT_LENGTHS = {"a": 5, "b": 13, "c": 1, "d": 22}


def check_mixed_batch(
    hf: PreTrainedModel,
    runner: ModelRunner,
    atol: float,
    rtol: float,
    lengths: dict[str, int] = PROMPT_LENGTHS,
) -> None:
    """Step 1: whole prompts a, b, c and the first 9 tokens of d. Step 2: the rest of d
    (after its cached prefix) alongside one decode of a."""
    ps = random_prompts(lengths, VOCAB)
    per_request = runner.model_info.max_model_len // runner.block_size
    split = 9
    step1 = [
        ScheduledRequest(rid, p[:split] if rid == "d" else p, 0,
                         list(range(i * per_request, (i + 1) * per_request)),
                         True, GREEDY, p, [])
        for i, (rid, p) in enumerate(ps.items())
    ]
    got1 = all_logits(runner, step1)
    extra = 77
    a, d = step1[0], step1[3]
    step2 = [
        ScheduledRequest("a", [extra], len(ps["a"]), a.block_ids, True, GREEDY, ps["a"], []),
        ScheduledRequest("d", ps["d"][split:], split, d.block_ids, True, GREEDY, ps["d"], []),
    ]
    got2 = all_logits(runner, step2)

    want = {rid: hf_logits(hf, p) for rid, p in ps.items()}
    want_a_next = hf_logits(hf, ps["a"] + [extra])[-1]
    offsets = [0]
    for r in step1:
        offsets.append(offsets[-1] + len(r.token_ids))
    for i, (rid, p) in enumerate(ps.items()):
        n = split if rid == "d" else len(p)
        torch.testing.assert_close(got1[offsets[i]:offsets[i + 1]], want[rid][:n],
                                   atol=atol, rtol=rtol, msg=rid)
    torch.testing.assert_close(got2[0], want_a_next, atol=atol, rtol=rtol)
    torch.testing.assert_close(got2[1:], want["d"][split:], atol=atol, rtol=rtol)
