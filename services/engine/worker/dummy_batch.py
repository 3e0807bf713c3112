"""The forward pass over zero tokens that an idle rank of an expert-parallel group runs.

While any rank of the group has work, every rank must run a forward each step, since
each MoE layer's collectives wait for all ranks (see `expert_parallel`). A rank with
nothing scheduled runs this one: its attention does nothing, its MoE layers contribute
no tokens but take part in the gathers and reductions, and it writes no KV cache slot.
"""

from __future__ import annotations

import torch
from torch import nn

from services.engine.models.attention_metadata import AttentionMetadata


def empty_attention_metadata(device: torch.device) -> AttentionMetadata:
    return AttentionMetadata(
        slot_mapping=torch.zeros(0, dtype=torch.int64, device=device),
        block_tables=torch.zeros((0, 1), dtype=torch.int32, device=device),
        seq_lens=torch.zeros(0, dtype=torch.int32, device=device),
        query_start_loc=torch.zeros(1, dtype=torch.int32, device=device),
        seq_lens_host=[],
        query_start_loc_host=[0],
    )


@torch.inference_mode()
def dummy_forward(model: nn.Module, kv_caches: list[torch.Tensor]) -> None:
    """Run `model` over zero tokens, joining every collective of its layers."""
    device = kv_caches[0].device
    no_tokens = torch.zeros(0, dtype=torch.int64, device=device)
    model(no_tokens, no_tokens, empty_attention_metadata(device), kv_caches)
