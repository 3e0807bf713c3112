"""Qwen3-MoE: Qwen3 (q/k norms) with sparse MoE MLPs and no shared expert.

Layer selection and `norm_topk_prob` read as in Qwen2-MoE (see qwen2_moe). Unlike
Qwen3's, its sliding window, when `use_sliding_window` is on, applies to every layer.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from services.engine.models.decoder_config import DecoderConfig, MoEConfig
from services.engine.models.moe import SparseMoeForCausalLM
from services.engine.models.qwen3 import Qwen3ForCausalLM


class Qwen3MoeForCausalLM(SparseMoeForCausalLM):
    @classmethod
    def config_from_hf(cls, hf_config: dict[str, Any]) -> DecoderConfig:
        window = hf_config.get("sliding_window") if hf_config.get("use_sliding_window") else None
        return dataclasses.replace(
            Qwen3ForCausalLM.config_from_hf(hf_config),
            sliding_window=int(window) if window else None,
            sliding_layers=None,
            moe=MoEConfig.from_hf(hf_config, "moe_intermediate_size", norm_topk_prob=None),
        )
