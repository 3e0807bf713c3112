"""Qwen3: the Llama decoder with an RMSNorm over each q and k head before RoPE.

Its head_dim is set in the config and need not be hidden_size / num_heads; q/k/v
bias follows `attention_bias` (off in the released checkpoints), as in Llama. Its
sliding window is switched on, per layer, as in Qwen2.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from services.engine.models.decoder_config import DecoderConfig
from services.engine.models.llama import LlamaForCausalLM
from services.engine.models.qwen2 import qwen_sliding_layers, qwen_sliding_window


class Qwen3ForCausalLM(LlamaForCausalLM):
    @classmethod
    def config_from_hf(cls, hf_config: dict[str, Any]) -> DecoderConfig:
        return dataclasses.replace(
            DecoderConfig.from_hf(hf_config),
            qk_norm=True,
            sliding_window=qwen_sliding_window(hf_config),
            sliding_layers=qwen_sliding_layers(hf_config) or None,
        )
