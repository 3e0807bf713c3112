"""TPGroup: the tensor-parallel ranks of one model as one process group.

Under tensor parallelism N ranks each hold a shard of every weight and of every KV
block, run the same batch in lockstep, and all-reduce (or all-gather) the partial
results of the sharded layers (`services.engine.models.tp_layers`). The collectives are
`collectives.Collectives`, as for the DP group, on a store and port of their own, so a
rank can be in both (tensor parallelism inside each expert-parallel DP rank).

One group per process: `init_tp_group` builds it and makes it the process's current
group, which the model loader reads (`current_tp_group`) to build the sharded model
and read only this rank's shard of the checkpoint. A group of one rank shards nothing.
Each worker calls it once, before it builds its model runner:

    init_tp_group(rank=r, world_size=n, master_addr="127.0.0.1", master_port=29600,
                  device=torch.device("cuda", r))
"""

from __future__ import annotations

import logging

import torch

from services.engine.parallel.collectives import Collectives, connect

logger = logging.getLogger(__name__)

_current: TPGroup | None = None


class TPGroup(Collectives):
    """The tensor-parallel group: `rank`, `world_size`, `all_reduce`, `all_gather`."""


def init_tp_group(
    rank: int,
    world_size: int,
    master_addr: str = "127.0.0.1",
    master_port: int = 29600,
    device: torch.device | None = None,
    timeout_s: float = 300.0,
) -> TPGroup:
    """Join the TP group of `world_size` ranks as `rank` and make it the current group.

    Rank 0 listens on `master_addr:master_port` (not the DP group's port); the call
    returns once every rank has joined, or raises after `timeout_s`, which also bounds
    every later collective. On a CUDA `device` with cupy installed, tensors travel over
    NCCL; otherwise over gloo.
    """
    global _current
    if _current is not None:
        raise RuntimeError("this process already joined a TP group")
    _current = connect(TPGroup, rank, world_size, master_addr, master_port, device, timeout_s)
    logger.info("joined TP group as rank %d of %d via %s:%d (%s)", rank, world_size,
                master_addr, master_port, _current.transport)
    return _current


def current_tp_group() -> TPGroup | None:
    """The group `init_tp_group` made current; None without tensor parallelism."""
    return _current


def leave_tp_group() -> None:
    """Leave the current group in step with the other ranks and close its connections."""
    global _current
    if _current is not None:
        _current.close()
    _current = None


def forget_tp_group() -> None:
    """Drop the current group without the closing barrier, once the other ranks are
    gone (a tensor-parallel executor that stopped its workers); a model built before
    keeps its reference. Lets the process build another executor later."""
    global _current
    _current = None
