"""A stand-in model whose logits never change: the serving path without the model's cost.

`benchmarks/overhead.py` serves it to measure what the scheduler, the model runner
(batch building, sampling) and gRPC cost per step; operators can use it the same way
to load-test a deployment. Its checkpoint is a config.json naming the architecture
`CorestreamFixedLogitsForCausalLM` and a safetensors file holding one `logits`
vector. It keeps a one-layer KV cache shape so that the runner allocates as usual,
but it never reads or writes it. A config.json key `corestream_step_seconds` makes each
forward sleep that long: a paced model whose steps cost wall time but no CPU, so that
every token wakes the whole serving path as a real model's would
(`benchmarks/cluster_cost.py --step-ms`).
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from services.engine.models.attention_metadata import AttentionMetadata
from services.engine.models.decoder_config import DecoderConfig
from services.engine.parallel.tp_group import TPGroup


@dataclass(frozen=True, slots=True)
class FixedLogitsConfig(DecoderConfig):
    step_seconds: float = 0.0
    """How long each forward sleeps."""

    def __post_init__(self) -> None:
        DecoderConfig.__post_init__(self)
        if not 0.0 <= self.step_seconds <= 10.0:
            raise ValueError(
                f"corestream_step_seconds must be in [0, 10], got {self.step_seconds}")


class CorestreamFixedLogitsForCausalLM(nn.Module):
    @classmethod
    def config_from_hf(cls, hf_config: dict[str, Any]) -> FixedLogitsConfig:
        return dataclasses.replace(
            FixedLogitsConfig.from_hf(hf_config),
            step_seconds=float(hf_config.get("corestream_step_seconds", 0.0)),
        )

    def __init__(self, config: FixedLogitsConfig) -> None:
        super().__init__()
        self.config = config
        self.logits = nn.Parameter(torch.zeros(config.vocab_size), requires_grad=False)
        # Replicated whole under tensor parallelism too: it has nothing to shard.
        self.local_kv_heads = config.num_key_value_heads
        self.tp: TPGroup | None = None

    def tie_weights(self) -> None:
        pass

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        meta: AttentionMetadata,
        kv_caches: list[torch.Tensor],
    ) -> torch.Tensor:
        if self.config.step_seconds:
            time.sleep(self.config.step_seconds)
        # [T, 1]: a hidden state per token, so that the runner's row selection works.
        return torch.zeros(input_ids.shape[0], 1, dtype=self.logits.dtype,
                           device=input_ids.device)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        # Contiguous like a real lm_head output: argmax over a stride-0 view is far slower.
        return self.logits.float().expand(hidden_states.shape[0], -1).contiguous()
