"""Qwen2 / Qwen2.5: the Llama decoder with bias on q, k and v (never on o).

Their configs carry `sliding_window` even when it is off; only `use_sliding_window`
turns it on, and then only for the layers that `layer_types` names "sliding_attention".
Configs older than `layer_types` slide every layer from `max_window_layers` on, which
is how transformers fills `layer_types` in when it is missing.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

from services.engine.models.decoder_config import DecoderConfig
from services.engine.models.llama import LlamaForCausalLM

_LAYER_TYPES = ("sliding_attention", "full_attention")


def _from_max_window_layers(layer: int, max_window_layers: int) -> bool:
    return layer >= max_window_layers


def qwen_sliding_layers(
    hf_config: dict[str, Any],
    slides_without_layer_types: Callable[[int, int], bool] = _from_max_window_layers,
) -> tuple[int, ...]:
    """The layers that attend through the window; () when `use_sliding_window` is off.

    `slides_without_layer_types(layer, max_window_layers)` is the family's rule for
    configs without `layer_types`.
    """
    if not hf_config.get("use_sliding_window") or not hf_config.get("sliding_window"):
        return ()
    num_layers = int(hf_config["num_hidden_layers"])
    layer_types = hf_config.get("layer_types")
    if layer_types is None:
        max_window_layers = int(hf_config.get("max_window_layers", num_layers))
        return tuple(
            i for i in range(num_layers) if slides_without_layer_types(i, max_window_layers)
        )
    unknown = sorted(set(layer_types) - set(_LAYER_TYPES))
    if unknown or len(layer_types) != num_layers:
        raise ValueError(
            f"layer_types must name one of {_LAYER_TYPES} for each of the {num_layers} "
            f"layers; got {len(layer_types)} entries, unsupported: {unknown}"
        )
    return tuple(i for i, kind in enumerate(layer_types) if kind == "sliding_attention")


def qwen_sliding_window(hf_config: dict[str, Any]) -> int | None:
    """The window Qwen configs enable, if any layer uses it (see `qwen_sliding_layers`)."""
    if not qwen_sliding_layers(hf_config):
        return None
    return int(hf_config["sliding_window"])


class Qwen2ForCausalLM(LlamaForCausalLM):
    @classmethod
    def config_from_hf(cls, hf_config: dict[str, Any]) -> DecoderConfig:
        return dataclasses.replace(
            DecoderConfig.from_hf(hf_config),
            qkv_bias=True,
            o_bias=False,
            sliding_window=qwen_sliding_window(hf_config),
            sliding_layers=qwen_sliding_layers(hf_config) or None,
        )
