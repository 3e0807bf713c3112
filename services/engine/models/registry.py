"""The architectures an engine can load, by the name config.json gives them.

Torch-free, and naming modules rather than importing them, so that `corestream serve`
refuses a checkpoint it cannot serve before any engine starts, and a new family is one
line here plus a module.
"""

from __future__ import annotations

# Architecture in config.json -> "module:class".
MODEL_REGISTRY: dict[str, str] = {
    "LlamaForCausalLM": "services.engine.models.llama:LlamaForCausalLM",
    "MistralForCausalLM": "services.engine.models.mistral:MistralForCausalLM",
    "Qwen2ForCausalLM": "services.engine.models.qwen2:Qwen2ForCausalLM",
    "Qwen3ForCausalLM": "services.engine.models.qwen3:Qwen3ForCausalLM",
    "MixtralForCausalLM": "services.engine.models.mixtral:MixtralForCausalLM",
    "Qwen2MoeForCausalLM": "services.engine.models.qwen2_moe:Qwen2MoeForCausalLM",
    "Qwen3MoeForCausalLM": "services.engine.models.qwen3_moe:Qwen3MoeForCausalLM",
    "CorestreamFixedLogitsForCausalLM": (
        "services.engine.models.fixed_logits:CorestreamFixedLogitsForCausalLM"
    ),
}


# Pooling checkpoints name the decoder they run on: `Qwen3ForSequenceClassification`
# (a score head on it) and `Qwen3Model` (no head) load as `Qwen3ForCausalLM` does.
_POOLING_SUFFIXES = ("ForSequenceClassification", "Model")


def generative_architecture(arch: str) -> str:
    """The registered class that computes `arch`'s hidden states (itself if registered)."""
    if arch in MODEL_REGISTRY:
        return arch
    for suffix in _POOLING_SUFFIXES:
        if arch.endswith(suffix) and (base := arch.removesuffix(suffix) + "ForCausalLM"
                                      ) in MODEL_REGISTRY:
            return base
    return arch


def supported(architectures: list[str]) -> str | None:
    """The first of `architectures` that an engine can load (a pooling architecture as
    the generative one it runs on), or None."""
    return next((generative_architecture(arch) for arch in architectures
                 if generative_architecture(arch) in MODEL_REGISTRY), None)


def unsupported_message(architectures: list[str]) -> str:
    return (f"no supported architecture among {architectures}; supported: "
            f"{sorted(MODEL_REGISTRY)}")
