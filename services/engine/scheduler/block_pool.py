"""BlockPool: the fixed set of KV-cache blocks, with reference counts, an LRU free
list and the prefix cache's hash -> block map.

A block is free when no request holds it (reference count 0). A free block that
was cached keeps its hash and contents: a later request with the same prefix can
revive it (`touch`) until a fresh block is needed and it is evicted. The free
list is therefore the eviction order, least recently freed first; an ordered
dict makes reviving a block from the middle of it O(1).

Only full, computed blocks are cached, and a cached block is never written
again: requests append to their own tail blocks only.

With a KvEventLog, every change of the hash -> block map is recorded (see
kv_events.py), so that frontends can mirror what this pool caches.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Sequence

from services.common.block_hash import NO_PARENT, BlockHash
from services.engine.scheduler.kv_events import KvEventLog


class BlockPool:
    def __init__(self, num_blocks: int, events: KvEventLog | None = None) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        self.num_blocks = num_blocks
        self._ref_counts = [0] * num_blocks
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self._cached: dict[BlockHash, int] = {}
        self._hash_of: dict[int, BlockHash] = {}
        self._events = events

    @property
    def num_free_blocks(self) -> int:
        """Blocks no request holds, cached ones included (they are evictable)."""
        return len(self._free)

    @property
    def num_cached_blocks(self) -> int:
        return len(self._cached)

    @property
    def usage(self) -> float:
        """Fraction of blocks held by requests, in [0, 1]."""
        return 1.0 - len(self._free) / self.num_blocks

    def allocate(self, n: int) -> list[int]:
        """n fresh blocks, evicting the least recently freed cached ones."""
        if n > len(self._free):
            raise ValueError(f"asked for {n} blocks, {len(self._free)} free")
        blocks = []
        for _ in range(n):
            b, _ = self._free.popitem(last=False)
            self._evict(b)
            self._ref_counts[b] = 1
            blocks.append(b)
        return blocks

    def free(self, block_ids: Iterable[int]) -> None:
        """Drop one reference each; blocks that reach 0 join the free list's tail, so
        the order given is the order in which they will be evicted."""
        for b in block_ids:
            if self._ref_counts[b] <= 0:
                raise ValueError(f"block {b} freed twice")
            self._ref_counts[b] -= 1
            if self._ref_counts[b] == 0:
                self._free[b] = None

    def lookup(self, block_hash: BlockHash) -> int | None:
        """The cached block holding these contents, held or free; None on a miss."""
        return self._cached.get(block_hash)

    def touch(self, block_ids: Iterable[int]) -> None:
        """Take a reference on cached blocks, reviving free ones from the free list."""
        for b in block_ids:
            if self._ref_counts[b] == 0:
                del self._free[b]
            self._ref_counts[b] += 1

    def cache(self, block_id: int, block_hash: BlockHash,
              parent_hash: BlockHash = NO_PARENT, token_ids: Sequence[int] = ()) -> None:
        """Record that a held, full block holds the contents named by block_hash;
        parent_hash and the block's own token_ids are for the events only."""
        if block_id in self._hash_of:
            return
        # Two requests that missed on the same prefix computed it twice: the first
        # copy stays the cached one and the second remains a private block.
        if block_hash in self._cached:
            return
        self._cached[block_hash] = block_id
        self._hash_of[block_id] = block_hash
        if self._events is not None:
            self._events.stored(block_hash, parent_hash, tuple(token_ids))

    def is_cached(self, block_id: int) -> bool:
        return block_id in self._hash_of

    def ref_count(self, block_id: int) -> int:
        return self._ref_counts[block_id]

    def cached_hashes(self) -> list[BlockHash]:
        """Every cached block's hash, held or free (a subscriber's snapshot)."""
        return list(self._cached)

    def free_block_ids(self) -> list[int]:
        """The free list in eviction order (first = next evicted)."""
        return list(self._free)

    def reset_cache(self) -> int:
        """Forget every cached block and return how many; refused (ValueError) while
        any block is held, since a held block's hash may still be shared by a table."""
        num_held = self.num_blocks - len(self._free)
        if num_held:
            raise ValueError(f"{num_held} KV blocks are still held by requests")
        num_cached = len(self._cached)
        self._cached.clear()
        self._hash_of.clear()
        if self._events is not None:
            self._events.cleared()
        return num_cached

    def forget_hashes(self) -> int:
        """Forget every cached block, held ones too, and return how many: their contents
        no longer name what they hold (the weights that computed them changed). A held
        block stays with its request, as a private block."""
        num_cached = len(self._cached)
        self._cached.clear()
        self._hash_of.clear()
        if self._events is not None:
            self._events.cleared()
        return num_cached

    def _evict(self, block_id: int) -> None:
        block_hash = self._hash_of.pop(block_id, None)
        if block_hash is not None:
            del self._cached[block_hash]
            if self._events is not None:
                self._events.removed(block_hash)

    def check_integrity(self) -> None:
        for b in range(self.num_blocks):
            if (self._ref_counts[b] == 0) != (b in self._free):
                raise AssertionError(f"block {b}: ref count {self._ref_counts[b]} but "
                                     f"{'in' if b in self._free else 'not in'} the free list")
        for h, b in self._cached.items():
            if self._hash_of.get(b) != h:
                raise AssertionError(f"block {b}: hash maps out of step")
        if len(self._cached) != len(self._hash_of):
            raise AssertionError("hash maps differ in size")
