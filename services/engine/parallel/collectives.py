"""Collectives: the all-reduce and all-gather of one process group, shared by the
data-parallel group (`dp_group`) and the tensor-parallel group (`tp_group`).

A group is a gloo process group over a TCPStore that rank 0 hosts; on CUDA the tensors
travel instead over an NCCL communicator from cupy (see `nccl`), which the store
bootstraps. Groups are built directly rather than through
`torch.distributed.init_process_group`: there is no default group to share, so one
process can be in a DP group and a TP group at once, each on its own store and port.

Every rank must call the collectives of a group in the same order with tensors of the
same shape; the group's timeout bounds each of them, so a rank that stops joining fails
its peers instead of hanging them. After such a failure the ranks `reform` the group: a
fresh gloo group under the next *epoch* (its keys prefixed in the same store), which the
first rank to ask moves on and the others join.
"""

from __future__ import annotations

import datetime
import logging
from typing import TYPE_CHECKING, TypeVar

import torch
import torch.distributed as dist

if TYPE_CHECKING:
    from services.engine.parallel.nccl import NcclCommunicator

logger = logging.getLogger(__name__)


class Collectives:
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
        self._timeout = timeout
        self._gloo = dist.ProcessGroupGloo(store, rank, world_size, timeout)
        self._nccl = nccl
        self.epoch = 0
        """How often the group was re-formed (`reform`)."""

    @property
    def transport(self) -> str:
        return "nccl" if self._nccl is not None else "gloo"

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

    def reform(self) -> int:
        """Replace the group's connections by fresh ones under the next epoch; returns
        it. Every live rank must call this (the call returns once all have, or raises
        after the group's timeout). The old group is dropped without a barrier: a peer
        may be gone. The epoch is agreed in the store: the first rank to ask moves it
        on from the one this rank knows, a later one finds it moved and joins it."""
        if self._nccl is not None:
            raise RuntimeError("re-forming a group whose tensors travel over NCCL is not "
                               "supported yet")
        known = str(self.epoch).encode()
        epoch = int(self._store.compare_set(EPOCH_KEY, known, str(self.epoch + 1).encode()))
        self._gloo = dist.ProcessGroupGloo(dist.PrefixStore(f"epoch-{epoch}", self._store),
                                           self.rank, self.world_size, self._timeout)
        self.epoch = epoch
        logger.info("%s re-formed as rank %d of %d under epoch %d", type(self).__name__,
                    self.rank, self.world_size, epoch)
        return epoch

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

    def broadcast(self, tensor: torch.Tensor, src: int) -> torch.Tensor:
        """Rank `src`'s `tensor` on every rank, in place (every rank passes one of the same
        shape and dtype); returns it."""
        if not tensor.is_contiguous():
            raise ValueError("broadcast needs a contiguous tensor (it fills it in place)")
        if tensor.is_cuda:
            if self._nccl is not None:
                self._nccl.broadcast(tensor, src)
            else:
                tensor.copy_(self.broadcast(tensor.cpu(), src))
            return tensor
        options = dist.BroadcastOptions()
        options.rootRank = src
        self._gloo.broadcast([tensor], options).wait()
        return tensor

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


GroupT = TypeVar("GroupT", bound=Collectives)
EPOCH_KEY = "corestream/epoch"
"""The store's key holding the group's current epoch (see `Collectives.reform`)."""


def connect(
    cls: type[GroupT],
    rank: int,
    world_size: int,
    master_addr: str,
    master_port: int,
    device: torch.device | None,
    timeout_s: float,
) -> GroupT:
    """A `cls` group of `world_size` ranks joined as `rank`.

    Rank 0 listens on `master_addr:master_port`; the call returns once every rank has
    joined, or raises after `timeout_s`, which also bounds every later collective. On a
    CUDA `device` with cupy installed, tensors travel over NCCL; otherwise over gloo.
    """
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    timeout = datetime.timedelta(seconds=timeout_s)
    store = dist.TCPStore(
        master_addr, master_port, world_size, is_master=rank == 0, timeout=timeout
    )
    if rank == 0:
        # Epoch 0, before the group exists: no rank can ask to re-form before then.
        store.compare_set(EPOCH_KEY, b"", b"0")
    nccl = None
    if device is not None and device.type == "cuda":
        nccl = _try_nccl(store, rank, world_size, device, cls.__name__)
    return cls(store, rank, world_size, timeout, nccl)


def _try_nccl(
    store: dist.Store, rank: int, world_size: int, device: torch.device, group: str
) -> NcclCommunicator | None:
    try:
        from services.engine.parallel.nccl import NcclCommunicator
        return NcclCommunicator(store, rank, world_size, device)
    except ImportError:
        logger.warning("cupy is not installed: %s collectives on %s go through host "
                       "memory and gloo; install corestream[gpu] for NCCL", group, device)
        return None
