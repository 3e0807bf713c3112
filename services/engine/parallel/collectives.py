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

A rank that never comes back can be left out: `reform(shrink=...)` lets the first rank
(the store's host, which every re-formed group keeps) decide, once the caller's patience
is spent, that the group goes on with the ranks that are back. The decision is written
in the store, so every waiting rank reads the same one; a rank not in it (the dead
one's replacement, come too late) is refused with `LeftOut`. Ranks are then numbered
afresh (their order kept); `members` says which ranks of the first group they were.
"""

from __future__ import annotations

import datetime
import json
import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, TypeVar

import torch
import torch.distributed as dist

from services.engine.parallel.errors import LeftOut

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
        self.members = list(range(world_size))
        """The ranks of the group as first formed that are in it now, in rank order
        (`members[rank]` is this rank's first rank); fewer after a `reform` left some
        out."""
        self.first_rank = rank
        """This rank's number in the group as first formed (its flag)."""
        self._store = store
        self._timeout = timeout
        self._gloo: dist.ProcessGroupGloo | None = (
            _gloo_group(store, 0, rank, world_size, timeout) if epoch == 0 else None)
        self._nccl = nccl
        self.epoch = epoch
        """How often the group was re-formed (`reform`)."""
        self._joining = epoch > 0
        """A replacement not yet taken in: it forms the epoch the others re-form under."""
        self._arrived = 0
        """The latest epoch this rank announced itself for."""
        self._target: int | None = None
        # The epoch a failed `reform` was forming: a retry forms the same one (the
        # others may be waiting there), unless the store's has moved on.

    @property
    def formed(self) -> bool:
        """False for a rank that replaces a failed one until `reform` took it in."""
        return not self._joining

    @property
    def timeout_s(self) -> float:
        """What bounds each collective and each wait to re-form."""
        return self._timeout.total_seconds()

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

    def drop(self) -> None:
        """Close this rank's connections of the group now, without a barrier: a peer
        waiting in one of its collectives fails at once instead of at the timeout (the
        ranks fell out of step in a failed step). `reform` forms the group anew."""
        self._gloo = None  # the last reference: gloo closes its pairs

    def move_epoch_on(self) -> None:
        """Move the group's epoch on now, as `reform` does first, without waiting: a
        replacement that connects before this rank calls `reform` must find it moved
        (else it would form the old epoch alone). Once per re-forming."""
        if self._joining or self._target is not None:
            return
        known = str(self.epoch).encode()
        self._target = int(self._store.compare_set(EPOCH_KEY, known,
                                                   str(self.epoch + 1).encode()))

    def reform(self, shrink: Callable[[list[int]], str | None] | None = None,
               members: list[int] | None = None) -> int:
        """Replace the group's connections by fresh ones under the next epoch; returns
        it. Every live rank must call this (the call returns once all have, or raises
        after the group's timeout). The old group is dropped without a barrier: a peer
        may be gone. The epoch is agreed in the store: the first rank to ask moves it
        on from the one this rank knows, a later one finds it moved and joins it.

        `shrink` given (the caller waited long enough for the missing ranks): on the
        first rank, re-form at once with the ranks that are back, if `shrink(members)`
        (their first ranks) returns None; a reason refuses it (`TimeoutError` with that
        reason, after the wait). Every other rank follows a decision it finds.

        `members` given (first ranks, a decision taken in another group: the tensor-
        parallel workers of engines whose rank 0s decided): the first rank decides
        exactly those, once they are all back."""
        if self._nccl is not None:
            raise NotImplementedError("re-forming a group whose tensors travel over NCCL "
                                      "is not supported yet")
        self._refuse_if_left_out()
        if self._joining:
            # A replacement: the epoch the others are re-forming under.
            self._target = int(self._store.get(EPOCH_KEY))
        elif self._target is None:
            self.move_epoch_on()
        else:
            self._target = max(self._target, int(self._store.get(EPOCH_KEY)))
        epoch = self._target
        members = self._wait_for_all(epoch, shrink, members)
        if members == self.members:
            group = _gloo_group(self._store, epoch, self.rank, self.world_size, self._timeout)
        else:
            rank = members.index(self.first_rank)
            # Keys of their own: a latecomer may have begun the full group's rendezvous.
            group = _gloo_group(self._store, epoch, rank, len(members), self._timeout,
                                suffix="/of-" + "-".join(map(str, members)))
            logger.warning("%s re-formed without ranks %s: rank %d of %d (was %d of %d)",
                           type(self).__name__, sorted(set(self.members) - set(members)),
                           rank, len(members), self.rank, self.world_size)
            self.rank, self.world_size, self.members = rank, len(members), members
        self._gloo = group
        self.epoch, self._target, self._joining = epoch, None, False
        logger.info("%s re-formed as rank %d of %d under epoch %d", type(self).__name__,
                    self.rank, self.world_size, epoch)
        return epoch

    def _refuse_if_left_out(self) -> None:
        raw = self._store.get(MEMBERS_KEY) if self._store.check([MEMBERS_KEY]) else b""
        if raw and self.first_rank not in (members := json.loads(raw)):
            raise LeftOut(
                f"rank {self.first_rank} was left out of the group, which went on as "
                f"ranks {members} of the first {len(self.members)} when it did not come "
                "back in time (engine_recovery_timeout_s); restart the whole group to "
                "bring it back")

    def _wait_for_all(self, epoch: int, shrink: Callable[[list[int]], str | None] | None,
                      imposed: list[int] | None = None) -> list[int]:
        """Announce this rank for `epoch` (once) and wait, up to the group's timeout,
        until every rank has, or the first rank decided to go on without some: the
        members of the group to form (first ranks). gloo's rendezvous keys are formed
        only once everybody is there (a retry would find an earlier attempt's stale
        addresses)."""
        key = f"epoch-{epoch}/arrived"
        decided = f"epoch-{epoch}/members"
        if self._arrived != epoch:
            # Who, before how many: the first rank reads who is here when it decides.
            self._store.set(f"{key}-{self.first_rank}", b"1")
            self._store.add(key, 1)
            self._arrived = epoch
        deciding = shrink is not None and self.first_rank == self.members[0]
        refused = ""
        deadline = time.monotonic() + self._timeout.total_seconds()
        while True:
            if self._store.check([decided]):
                members: list[int] = json.loads(self._store.get(decided))
                if self.first_rank not in members:
                    raise LeftOut(f"rank {self.first_rank} came too late for epoch {epoch}: "
                                  f"the group went on as ranks {members}")
                return members
            here = self._store.add(key, 0)
            if here >= self.world_size:
                return self.members
            if imposed is not None and self.first_rank == self.members[0]:
                if all(self._store.check([f"{key}-{r}"]) for r in imposed):
                    self._decide(decided, imposed)
                    continue
            elif deciding and not refused:
                back = [r for r in self.members if self._store.check([f"{key}-{r}"])]
                refused = (shrink(back) or "") if shrink is not None else ""
                if not refused:
                    self._decide(decided, back)
                    continue
            if time.monotonic() >= deadline:
                raise TimeoutError(f"{here} of {self.world_size} ranks are back for epoch "
                                   f"{epoch} after {self._timeout.total_seconds():g} s"
                                   + (f"; the ranks back cannot go on without the others: {refused}"
                                      if refused else ""))
            time.sleep(0.05)

    def _decide(self, key: str, members: list[int]) -> None:
        """The first rank's decision: the group goes on as `members`. Set once, for the
        epoch and for good (a later replacement of a left-out rank reads it too)."""
        value = json.dumps(members).encode()
        if self._store.compare_set(key, b"", value) == value:
            self._store.set(MEMBERS_KEY, value)

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
                timeout: datetime.timedelta, suffix: str = "") -> dist.ProcessGroupGloo:
    """The gloo group of `epoch` (each epoch's keys under a prefix of their own; epoch 0
    is the group as first formed, on the store's own keys)."""
    scoped = store if epoch == 0 else dist.PrefixStore(f"epoch-{epoch}{suffix}", store)
    return dist.ProcessGroupGloo(scoped, rank, world_size, timeout)


GroupT = TypeVar("GroupT", bound=Collectives)
EPOCH_KEY = "corestream/epoch"
"""The store's key holding the group's current epoch (see `Collectives.reform`)."""
MEMBERS_KEY = "corestream/members"
"""Set once the group went on without some ranks: the first ranks still in it (JSON)."""


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
    group = cls(store, rank, world_size, timeout, nccl, epoch)
    if epoch:
        group._refuse_if_left_out()  # before the caller loads a model for nothing
    return group


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
