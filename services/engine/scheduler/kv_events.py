"""The prefix cache's changes, as events a frontend can replay into a mirror.

Frontends route each request to the engine that already caches its prefix, so
they keep an index block hash -> engines. An engine tells them what it caches:
a subscriber first gets a snapshot (every cached hash, and the seq of the last
event it includes), then every later event. Replaying them keeps an exact copy:

    stored:  the block joined the cache (parent: the block before it, NO_PARENT
             for a request's first block, so a mirror may rebuild the chains; its
             token ids, for routers that hash blocks their own way, as llm-d's do)
    removed: the block was evicted, its memory reused
    cleared: every block was dropped (an admin reset)

Seqs are consecutive from 1 within an epoch; the epoch is random per KvEventLog
(one per engine process), so a restarted engine, whose cache is new, cannot be
mistaken for the old one.

The log is written only by the busy-loop thread (the block pool's owner) and
drained there once per step, so recording stays cheap when nobody listens: the
events are dropped after routing finds no subscriber.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass

from services.common.block_hash import BlockHash


@dataclass(frozen=True, slots=True)
class BlockStored:
    seq: int
    block_hash: BlockHash
    parent_hash: BlockHash
    token_ids: tuple[int, ...] = ()


@dataclass(frozen=True, slots=True)
class BlockRemoved:
    seq: int
    block_hash: BlockHash


@dataclass(frozen=True, slots=True)
class CacheCleared:
    seq: int


KvEvent = BlockStored | BlockRemoved | CacheCleared


class KvEventLog:
    def __init__(self, epoch: str | None = None) -> None:
        self.epoch = epoch if epoch is not None else uuid.uuid4().hex
        self._last_seq = 0
        self._pending: list[KvEvent] = []

    @property
    def last_seq(self) -> int:
        """The seq of the latest event recorded (0 before the first)."""
        return self._last_seq

    @property
    def has_pending(self) -> bool:
        return bool(self._pending)

    def stored(self, block_hash: BlockHash, parent_hash: BlockHash,
               token_ids: tuple[int, ...] = ()) -> None:
        self._pending.append(BlockStored(self._next_seq(), block_hash, parent_hash, token_ids))

    def removed(self, block_hash: BlockHash) -> None:
        self._pending.append(BlockRemoved(self._next_seq(), block_hash))

    def cleared(self) -> None:
        self._pending.append(CacheCleared(self._next_seq()))

    def drain(self) -> tuple[KvEvent, ...]:
        """The events recorded since the last drain, oldest first."""
        if not self._pending:
            return ()
        events, self._pending = tuple(self._pending), []
        return events

    def _next_seq(self) -> int:
        self._last_seq += 1
        return self._last_seq
