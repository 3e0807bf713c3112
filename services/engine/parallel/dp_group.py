"""DPGroup: the data-parallel ranks of one model as one process group.

A mixture-of-experts model splits its experts over the DP ranks, so every MoE layer of
every forward is a pair of collectives that all ranks must join in the same order. The
collectives themselves (gloo, or NCCL on CUDA) are `collectives.Collectives`, which the
tensor-parallel group (`tp_group`) shares; the two groups use separate stores and ports,
so a rank can be in both.

One group per process: `init_dp_group` builds it and makes it the process's current
group, which the model loader reads (`current_dp_group`) when it builds an MoE model,
so that each rank constructs and loads only its own experts. The engine calls
`init_dp_group` once at start, before it builds its model runner:

    init_dp_group(rank=r, world_size=n, master_addr="10.0.0.1", master_port=29500,
                  device=torch.device("cuda", 0))
"""

from __future__ import annotations

import logging

import torch

from services.engine.parallel.collectives import Collectives, connect

logger = logging.getLogger(__name__)

_current: DPGroup | None = None


class DPGroup(Collectives):
    """The data-parallel group: `rank`, `world_size`, `all_reduce`, `all_gather`."""


def init_dp_group(
    rank: int,
    world_size: int,
    master_addr: str = "127.0.0.1",
    master_port: int = 29500,
    device: torch.device | None = None,
    timeout_s: float = 300.0,
) -> DPGroup:
    """Join the DP group of `world_size` ranks as `rank` and make it the current group.

    Rank 0 listens on `master_addr:master_port`; the call returns once every rank has
    joined, or raises after `timeout_s`, which also bounds every later collective (a rank
    that stops joining them fails the others instead of hanging them). On a CUDA
    `device` with cupy installed, tensors travel over NCCL; otherwise over gloo.
    """
    global _current
    if _current is not None:
        raise RuntimeError("this process already joined a DP group")
    _current = connect(DPGroup, rank, world_size, master_addr, master_port, device, timeout_s)
    logger.info("joined DP group as rank %d of %d via %s:%d (%s)", rank, world_size,
                master_addr, master_port, _current.transport)
    return _current


def current_dp_group() -> DPGroup | None:
    """The group `init_dp_group` made current; None in a single-rank deployment."""
    return _current


def leave_dp_group() -> None:
    """Leave the current group in step with the other ranks and close its connections."""
    global _current
    if _current is not None:
        _current.close()
    _current = None
