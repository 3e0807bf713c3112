"""The weight-transfer group: a trainer and the engine's ranks, for broadcasting new
weights.

The trainer is rank 0 and hosts the group's TCPStore at (master_address, master_port);
an engine's tensor-parallel rank r joins as rank_offset + r, so several engines (each
given its own offset) share one group. Tensors travel over gloo on CPU, over NCCL
through cupy on CUDA (`Collectives`). The trainer side is `trainer.py`.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from services.engine.parallel.collectives import Collectives, connect
from services.engine.weights.staging import WeightUpdateError

logger = logging.getLogger(__name__)

TRAINER_RANK = 0

DEFAULT_TIMEOUT_S = 300.0
"""How long joining the group, and each broadcast after, may take before it fails: a
trainer computing its next weights between broadcasts must not trip it."""


@dataclass(frozen=True, slots=True)
class TransferGroupSpec:
    master_address: str
    master_port: int
    rank_offset: int
    world_size: int
    timeout_s: float = DEFAULT_TIMEOUT_S

    def __post_init__(self) -> None:
        if not self.master_address:
            raise WeightUpdateError("master_address is required")
        if not 0 < self.master_port < 65536:
            raise WeightUpdateError(f"master_port must be in [1, 65535], got {self.master_port}")
        if self.rank_offset < 1:
            raise WeightUpdateError(f"rank_offset must be >= 1 (rank 0 is the trainer), got "
                                    f"{self.rank_offset}")
        if self.world_size < 2:
            raise WeightUpdateError(f"world_size must be >= 2 (the trainer and an engine), "
                                    f"got {self.world_size}")
        if self.timeout_s <= 0:
            raise WeightUpdateError(f"timeout_s must be > 0, got {self.timeout_s}")

    def rank_of(self, tp_rank: int, tp_size: int) -> int:
        rank = self.rank_offset + tp_rank
        if self.rank_offset + tp_size > self.world_size:
            raise WeightUpdateError(
                f"rank_offset {self.rank_offset} + {tp_size} tensor-parallel rank(s) exceed "
                f"world_size {self.world_size}")
        return rank


def join_transfer_group(spec: TransferGroupSpec, tp_rank: int, tp_size: int,
                        device: torch.device | None) -> Collectives:
    """Join the trainer's group; returns once every rank has joined (blocks until then,
    up to the spec's timeout)."""
    rank = spec.rank_of(tp_rank, tp_size)
    logger.info("joining the weight-transfer group at %s:%d as rank %d of %d",
                spec.master_address, spec.master_port, rank, spec.world_size)
    try:
        return connect(Collectives, rank, spec.world_size, spec.master_address,
                       spec.master_port, device if device is not None and device.type == "cuda"
                       else None, spec.timeout_s)
    except RuntimeError as exc:
        raise WeightUpdateError(
            f"could not join the weight-transfer group at {spec.master_address}:"
            f"{spec.master_port} as rank {rank}: {exc}") from None
