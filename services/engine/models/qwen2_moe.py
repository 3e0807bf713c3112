"""Qwen2-MoE (Qwen1.5-MoE, Qwen2-57B-A14B): Qwen2 with sparse MoE MLPs and a shared expert.

Every `decoder_sparse_step`-th layer not in `mlp_only_layers` is sparse; its experts are
`moe_intermediate_size` wide, and `norm_topk_prob` says whether the top-k routing
weights are renormalized. q/k/v carry a bias unless the config's `qkv_bias` says not.
A sliding window, when `use_sliding_window` is on, applies to the layers `layer_types`
names, or else to every other layer below `max_window_layers` (transformers' default
for this family, unlike Qwen2's).
"""

from __future__ import annotations

import dataclasses
from typing import Any

from services.engine.models.decoder_config import DecoderConfig, MoEConfig
from services.engine.models.moe import SparseMoeForCausalLM
from services.engine.models.qwen2 import qwen_sliding_layers


def _every_other_layer_below(layer: int, max_window_layers: int) -> bool:
    return layer % 2 == 0 and layer < max_window_layers


class Qwen2MoeForCausalLM(SparseMoeForCausalLM):
    @classmethod
    def config_from_hf(cls, hf_config: dict[str, Any]) -> DecoderConfig:
        sliding = qwen_sliding_layers(hf_config, _every_other_layer_below)
        return dataclasses.replace(
            DecoderConfig.from_hf(hf_config),
            qkv_bias=bool(hf_config.get("qkv_bias", True)),
            o_bias=False,
            sliding_window=int(hf_config["sliding_window"]) if sliding else None,
            sliding_layers=sliding or None,
            moe=MoEConfig.from_hf(hf_config, "moe_intermediate_size", norm_topk_prob=None),
        )
