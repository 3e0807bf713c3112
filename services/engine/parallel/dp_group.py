"""DPGroup: the data-parallel ranks of one model as one process group.

A mixture-of-experts model splits its experts over the DP ranks, so every MoE layer of
every forward is a pair of collectives that all ranks must join in the same order. The
group is a gloo process group over a TCPStore that rank 0 hosts; on CUDA the tensors
travel instead over an NCCL communicator from cupy (see `nccl`), which the store
bootstraps. The group is built directly rather than through
`torch.distributed.init_process_group`, so it leaves the default (world) group free for
tensor parallelism inside a rank.

One group per process: `init_dp_group` builds it and makes it the process's current
group, which the model loader reads (`current_dp_group`) when it builds an MoE model,
so that each rank constructs and loads only its own experts. The engine calls
`init_dp_group` once at start, before it builds its model runner:

    init_dp_group(rank=r, world_size=n, master_addr="10.0.0.1", master_port=29500,
                  device=torch.device("cuda", 0))
"""

from __future__ import annotations

import datetime
import logging
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

if TYPE_CHECKING:
    from services.engine.parallel.nccl import NcclCommunicator

logger = logging.getLogger(__name__)

_current: DPGroup | None = None


class DPGroup:
    def __init__(
        self,
        store: dist.Store,
        rank: int,
        world_size: int,
        timeout: datetime.timedelta,
        nccl: NcclCommunicator | None = None,
    ) -> None:
        if not 0 <= rank < world_size:
            raise ValueError(f"rank must be in [0, world_size {world_size}), got {rank}")
        self.rank = rank
        self.world_size = world_size
        self._store = store
        self._gloo = dist.ProcessGroupGloo(store, rank, world_size, timeout)
        self._nccl = nccl

    def close(self) -> None:
        """Wait until every rank is leaving, then close the group's connections.

        NOTE: a rank that simply exits while a peer's gloo threads still hold the
        connection open sometimes takes that peer down with SIGABRT ("terminate called
        without an active exception") as its interpreter shuts down; every rank must
        call this, as with any collective.
        """
        self._gloo.barrier().wait()
        del self._gloo
        del self._store

    def all_gather(self, tensor: torch.Tensor) -> torch.Tensor:
        """`[world_size, *tensor.shape]`: every rank's `tensor`, in rank order.

        Every rank must pass a tensor of the same shape and dtype.
        """
        out = tensor.new_empty((self.world_size, *tensor.shape))
        if tensor.is_cuda:
            if self._nccl is not None:
                self._nccl.all_gather(tensor.contiguous(), out)
                return out
            return self.all_gather(tensor.cpu()).to(tensor.device)
        self._gloo.allgather([list(out.unbind(0))], [tensor.contiguous()]).wait()
        return out

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        """Sum `tensor` over the ranks, in place; returns it."""
        if not tensor.is_contiguous():
            raise ValueError("all_reduce needs a contiguous tensor (it reduces in place)")
        if tensor.is_cuda:
            if self._nccl is not None:
                self._nccl.all_reduce(tensor)
            else:
                tensor.copy_(self.all_reduce(tensor.cpu()))
            return tensor
        self._gloo.allreduce([tensor]).wait()
        return tensor


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
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    timeout = datetime.timedelta(seconds=timeout_s)
    store = dist.TCPStore(
        master_addr, master_port, world_size, is_master=rank == 0, timeout=timeout
    )
    nccl = None
    if device is not None and device.type == "cuda":
        nccl = _try_nccl(store, rank, world_size, device)
    _current = DPGroup(store, rank, world_size, timeout, nccl)
    logger.info("joined DP group as rank %d of %d via %s:%d (%s)", rank, world_size,
                master_addr, master_port, "nccl" if nccl else "gloo")
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


def _try_nccl(
    store: dist.Store, rank: int, world_size: int, device: torch.device
) -> NcclCommunicator | None:
    try:
        from services.engine.parallel.nccl import NcclCommunicator
        return NcclCommunicator(store, rank, world_size, device)
    except ImportError:
        logger.warning("cupy is not installed: DP collectives on %s go through host "
                       "memory and gloo; install corestream[gpu] for NCCL", device)
        return None
