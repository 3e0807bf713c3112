"""Mixtral: the Mistral decoder with a sparse MoE MLP in every layer.

Its checkpoints call the MoE module `block_sparse_moe` and an expert's projections
w1 (gate), w3 (up) and w2 (down); its top-k routing weights are always renormalized.
"""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar

from services.engine.models.decoder_config import DecoderConfig, MoEConfig
from services.engine.models.mistral import MistralForCausalLM
from services.engine.models.moe import SparseMoeForCausalLM


class MixtralForCausalLM(SparseMoeForCausalLM):
    packed_experts: ClassVar[dict[str, tuple[str, ...]]] = {"w13": ("w1", "w3"), "w2": ("w2",)}
    checkpoint_renames: ClassVar[dict[str, str]] = {"block_sparse_moe": "mlp"}

    @classmethod
    def config_from_hf(cls, hf_config: dict[str, Any]) -> DecoderConfig:
        return dataclasses.replace(
            MistralForCausalLM.config_from_hf(hf_config),
            moe=MoEConfig.from_hf(hf_config, "intermediate_size", norm_topk_prob=True),
        )
