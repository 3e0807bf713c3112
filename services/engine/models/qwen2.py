"""Qwen2 / Qwen2.5: the Llama decoder with bias on q, k and v (never on o).

Their configs carry `sliding_window` even when it is off; only `use_sliding_window`
turns it on, for the layers that `layer_types` (or `max_window_layers`) name.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from services.engine.models.decoder_config import DecoderConfig
from services.engine.models.llama import LlamaForCausalLM


def qwen_sliding_window(hf_config: dict[str, Any]) -> int | None:
    """The window Qwen configs enable, if any layer uses it."""
    window = hf_config.get("sliding_window")
    if not hf_config.get("use_sliding_window") or window is None:
        return None
    layer_types = hf_config.get("layer_types")
    if layer_types is not None:
        slides = "sliding_attention" in layer_types
    else:
        num_layers = int(hf_config["num_hidden_layers"])
        slides = int(hf_config.get("max_window_layers", num_layers)) < num_layers
    # One window for the whole model: the loader only has to know whether any layer slides.
    return int(window) if slides else None


class Qwen2ForCausalLM(LlamaForCausalLM):
    @classmethod
    def config_from_hf(cls, hf_config: dict[str, Any]) -> DecoderConfig:
        return dataclasses.replace(
            DecoderConfig.from_hf(hf_config),
            qkv_bias=True,
            o_bias=False,
            sliding_window=qwen_sliding_window(hf_config),
        )
