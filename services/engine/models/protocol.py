"""CausalLM: what the model runner and the loader need of a model.

Every model here is an `nn.Module` that satisfies this protocol structurally (no base
class): the Llama family and its relatives (llama.py, moe.py and the families built
on them) and the fixed-logits stand-in (fixed_logits.py). The runner drives a step
through `forward` (by calling the module) and `compute_logits`, sizes the KV cache
from `config` and `local_kv_heads`, and reads `tp` to know whether the model is
sharded. A model that can run a whole greedy decode step in one native call also
satisfies `GreedyDecoder`, which the runner checks for once, at load.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Protocol, runtime_checkable

import torch
from torch import nn

from services.engine.models.attention_metadata import AttentionMetadata
from services.engine.models.decoder_config import DecoderConfig
from services.engine.parallel.tp_group import TPGroup


class CausalLM(Protocol):
    config: DecoderConfig
    local_kv_heads: int
    """KV heads in this rank's cache: all of them without tensor parallelism."""
    tp: TPGroup | None
    """The tensor-parallel group the model is sharded over; None: whole on this rank."""

    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor,
                 meta: AttentionMetadata, kv_caches: list[torch.Tensor]) -> torch.Tensor:
        """`forward`, through `nn.Module.__call__`."""
        ...

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                meta: AttentionMetadata, kv_caches: list[torch.Tensor]) -> torch.Tensor:
        """Final hidden states `[T, hidden]` for tokens `[T]` at `positions` `[T]`;
        `kv_caches[i]` is layer i's cache `[2, num_blocks, block_size, kv_heads, head_dim]`."""
        ...

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """float32 logits `[N, vocab]` for hidden states `[N, hidden]`; the full
        vocabulary on every rank under tensor parallelism."""
        ...

    def parameters(self, recurse: bool = True) -> Iterator[nn.Parameter]: ...


@runtime_checkable
class GreedyDecoder(Protocol):
    """Optional: a model that runs a whole greedy decode step from host lists."""

    def decode_greedy(self, kv_caches: list[torch.Tensor], input_ids: list[int],
                      positions: list[int], slot_mapping: list[int],
                      block_tables: list[Sequence[int]], seq_lens: list[int]
                      ) -> list[int] | None:
        """Each sequence's greedy next token, or None where the native op does not
        apply (then the runner runs `forward`)."""
        ...
