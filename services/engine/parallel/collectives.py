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
import time
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
        epoch: int = 0,
    ) -> None:
        """`epoch` > 0: the group was re-formed before this rank came (it replaces one
        that failed): it is formed by `reform`, when the others take it in."""
        if not 0 <= rank < world_size:
            raise ValueError(f"rank must be in [0, world_size {world_size}), got {rank}")
        self.rank = rank
        self.world_size = world_size
        self._store = store
        self._timeout = timeout
        self._gloo: dist.ProcessGroupGloo | None = (
            _gloo_group(store, 0, rank, world_size, timeout) if epoch == 0 else None)
        self._nccl = nccl
        self.epoch = epoch
        """How often the group was re-formed (`reform`)."""
        self._arrived = 0
        """The latest epoch this rank announced itself for."""
        self._target: int | None = None
        # The epoch a failed `reform` was forming: a retry forms the same one (the
        # others may be waiting there), unless the store's has moved on.

    @property
    def formed(self) -> bool:
        """False for a rank that replaces a failed one until `reform` took it in."""
        return self._gloo is not None

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
            raise NotImplementedError("re-forming a group whose tensors travel over NCCL "
                                      "is not supported yet")
        if self._gloo is None:
            # A replacement: the epoch the others are re-forming under.
            self._target = int(self._store.get(EPOCH_KEY))
        elif self._target is None:
            known = str(self.epoch).encode()
            self._target = int(self._store.compare_set(EPOCH_KEY, known,
                                                       str(self.epoch + 1).encode()))
        else:
            self._target = max(self._target, int(self._store.get(EPOCH_KEY)))
        epoch = self._target
        self._wait_for_all(epoch)
        self._gloo = _gloo_group(self._store, epoch, self.rank, self.world_size, self._timeout)
        self.epoch, self._target = epoch, None
        logger.info("%s re-formed as rank %d of %d under epoch %d", type(self).__name__,
                    self.rank, self.world_size, epoch)
        return epoch

    def _wait_for_all(self, epoch: int) -> None:
        """Announce this rank for `epoch` (once) and wait, up to the group's timeout,
        until every rank has: gloo's rendezvous keys are formed only once everybody is
        there (a retry would find an earlier attempt's stale addresses)."""
        key = f"epoch-{epoch}/arrived"
        if self._arrived != epoch:
            self._store.add(key, 1)
            self._arrived = epoch
        deadline = time.monotonic() + self._timeout.total_seconds()
        while (here := self._store.add(key, 0)) < self.world_size:
            if time.monotonic() >= deadline:
                raise TimeoutError(f"{here} of {self.world_size} ranks are back for epoch "
                                   f"{epoch} after {self._timeout.total_seconds():g} s")
            time.sleep(0.05)

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


def _gloo_group(store: dist.Store, epoch: int, rank: int, world_size: int,
                timeout: datetime.timedelta) -> dist.ProcessGroupGloo:
    """The gloo group of `epoch` (each epoch's keys under a prefix of their own; epoch 0
    is the group as first formed, on the store's own keys)."""
    scoped = store if epoch == 0 else dist.PrefixStore(f"epoch-{epoch}", store)
    return dist.ProcessGroupGloo(scoped, rank, world_size, timeout)


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
    # Past 0 when this rank replaces one that failed: the group forms it later (reform).
    epoch = int(store.get(EPOCH_KEY))
    if epoch and device is not None and device.type == "cuda":
        raise NotImplementedError("a rank replacing a failed one of a group on CUDA cannot "
                                  "join it yet (NCCL communicators are not re-formed)")
    nccl = None
    if device is not None and device.type == "cuda":
        nccl = _try_nccl(store, rank, world_size, device, cls.__name__)
    return cls(store, rank, world_size, timeout, nccl, epoch)


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
