"""PrefixIndex: which engine holds which cached KV blocks, from the engines' own events.

Each engine subscribed on its Session sends a snapshot of its prefix cache, then
every block it stores or evicts. The index keeps, per block hash, the engines that
hold it, so that a prompt hashed the way the engines hash it (the shared
services/common/block_hash.py) finds each engine's longest cached prefix.

Routing does not wait for the events of its own decisions: the blocks a request is
about to create are counted at once for the engine it was sent to, as predictions
that expire unless the engine's own event confirms them first. Without that, a
burst of requests with a new common prefix would scatter over the engines before
the first one's blocks were reported.

Memory is bounded: past `max_blocks` hashes the least recently used go first.
Forgetting a block only makes routing underestimate a hit, never send a request
somewhere that lacks what the index claims (an engine recomputes what it lacks).
"""

from __future__ import annotations

import math
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

from services.common.block_hash import BlockHash

CONFIRMED = math.inf
"""The expiry of a block the engine itself reported."""


@dataclass
class _EngineView:
    epoch: str
    seq: int
    block_size: int


class PrefixIndex:
    def __init__(self, max_blocks: int = 1 << 20, prediction_ttl_s: float = 30.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if max_blocks < 1:
            raise ValueError(f"max_blocks must be >= 1, got {max_blocks}")
        self._max_blocks = max_blocks
        self._ttl_s = prediction_ttl_s
        self._clock = clock
        # hash -> {engine: expiry}; in least-recently-used order.
        self._blocks: OrderedDict[BlockHash, dict[str, float]] = OrderedDict()
        self._engines: dict[str, _EngineView] = {}

    def __len__(self) -> int:
        return len(self._blocks)

    def tracks(self, engine: str) -> bool:
        return engine in self._engines

    def block_size(self, engine: str) -> int | None:
        view = self._engines.get(engine)
        return None if view is None else view.block_size

    # ---- the engines' events -----------------------------------------------------

    def apply_snapshot(self, engine: str, epoch: str, seq: int, block_size: int,
                       block_hashes: Iterable[BlockHash]) -> None:
        """Start (or restart) following an engine from its whole cache content."""
        self.drop_engine(engine)
        self._engines[engine] = _EngineView(epoch, seq, block_size)
        for block_hash in block_hashes:
            self._hold(block_hash, engine, CONFIRMED)

    def stored(self, engine: str, seq: int, block_hash: BlockHash) -> bool:
        """Apply one event; False when it does not follow the last one (a lost event:
        the caller must resubscribe) or the engine is not followed."""
        if not self._next(engine, seq):
            return False
        self._hold(block_hash, engine, CONFIRMED)
        return True

    def removed(self, engine: str, seq: int, block_hash: BlockHash) -> bool:
        if not self._next(engine, seq):
            return False
        holders = self._blocks.get(block_hash)
        if holders is not None:
            holders.pop(engine, None)
            if not holders:
                del self._blocks[block_hash]
        return True

    def cleared(self, engine: str, seq: int) -> bool:
        if not self._next(engine, seq):
            return False
        self._forget(engine)  # its blocks; the engine is still followed
        return True

    def drop_engine(self, engine: str) -> None:
        """Forget an engine (it left, its Session broke, or it lost an event)."""
        if self._engines.pop(engine, None) is not None:
            self._forget(engine)

    # ---- routing -------------------------------------------------------------------

    def match(self, hashes: Sequence[BlockHash], engines: Iterable[str]) -> dict[str, int]:
        """How many leading blocks of `hashes` each engine holds (0 for none)."""
        now = self._clock()
        counts = dict.fromkeys(engines, 0)
        alive = set(counts)
        for i, block_hash in enumerate(hashes):
            holders = self._blocks.get(block_hash)
            if holders is None:
                break
            alive = {e for e in alive if holders.get(e, 0.0) > now}
            if not alive:
                break
            for engine in alive:
                counts[engine] = i + 1
            self._blocks.move_to_end(block_hash)
        return counts

    def predict(self, engine: str, hashes: Iterable[BlockHash]) -> None:
        """Count blocks a request routed to `engine` is about to create, until the
        engine confirms them or the prediction expires."""
        if engine not in self._engines:
            return
        expiry = self._clock() + self._ttl_s
        for block_hash in hashes:
            holders = self._blocks.get(block_hash)
            if holders is None or holders.get(engine, 0.0) < expiry:
                self._hold(block_hash, engine, expiry)

    # ---- internals -----------------------------------------------------------------

    def _next(self, engine: str, seq: int) -> bool:
        view = self._engines.get(engine)
        if view is None or seq != view.seq + 1:
            return False
        view.seq = seq
        return True

    def _hold(self, block_hash: BlockHash, engine: str, expiry: float) -> None:
        holders = self._blocks.get(block_hash)
        if holders is None:
            holders = self._blocks[block_hash] = {}
        else:
            self._blocks.move_to_end(block_hash)
        holders[engine] = expiry
        while len(self._blocks) > self._max_blocks:
            self._blocks.popitem(last=False)

    def _forget(self, engine: str) -> None:
        empty = []
        for block_hash, holders in self._blocks.items():
            if holders.pop(engine, None) is not None and not holders:
                empty.append(block_hash)
        for block_hash in empty:
            del self._blocks[block_hash]
