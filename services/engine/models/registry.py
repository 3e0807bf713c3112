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


def supported(architectures: list[str]) -> str | None:
    """The first of `architectures` that an engine can load, or None."""
    return next((arch for arch in architectures if arch in MODEL_REGISTRY), None)


def unsupported_message(architectures: list[str]) -> str:
    return (f"no supported architecture among {architectures}; supported: "
            f"{sorted(MODEL_REGISTRY)}")
