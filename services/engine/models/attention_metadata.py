"""Per-step attention inputs, built once by the model runner and read by every layer.

Device tensors feed the kernels; the `_host` lists carry the same numbers as Python
ints so that the CPU attention path can loop over sequences without a device sync.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True, slots=True)
class AttentionMetadata:
    slot_mapping: torch.Tensor
    """[T] int64: cache slot (block_id * block_size + offset) of every input token."""
    block_tables: torch.Tensor
    """[B, max_blocks] int32: each sequence's blocks, padded with a valid id (0)."""
    seq_lens: torch.Tensor
    """[B] int32: tokens in the cache per sequence after this step's write."""
    query_start_loc: torch.Tensor
    """[B + 1] int32: offsets of each sequence's tokens in the flattened batch. The Triton
    attention kernel reads it in every layer: one host-to-device copy per step."""
    seq_lens_host: list[int]
    query_start_loc_host: list[int]

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens_host)
