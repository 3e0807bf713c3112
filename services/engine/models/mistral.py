"""Mistral: the Llama decoder with a sliding attention window.

Checkpoints from v0.2 on set `sliding_window` to null; v0.1 uses 4096, in every
layer: each token attends to itself and the 4095 tokens before it.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from services.engine.models.decoder_config import DecoderConfig
from services.engine.models.llama import LlamaForCausalLM


class MistralForCausalLM(LlamaForCausalLM):
    @classmethod
    def config_from_hf(cls, hf_config: dict[str, Any]) -> DecoderConfig:
        window = hf_config.get("sliding_window")
        return dataclasses.replace(
            DecoderConfig.from_hf(hf_config),
            sliding_window=None if window is None else int(window),
        )
