"""KVCacheManager: each request's block table, grown as its tokens grow, with
prefix caching of full blocks.

Life of a request's blocks:
- admission: `find_cached_prefix` names the longest run of cached blocks that
  match the request's leading full blocks (by chained hash); `allocate_slots`
  takes a reference on them and adds fresh blocks for the tokens to compute;
- after each step: `cache_full_blocks` publishes the blocks the step filled, so
  that later requests (or this one, after a preemption) can reuse them;
- finish or preemption: `free` drops the references; cached blocks stay reusable
  in the pool's free list until evicted.
"""

from __future__ import annotations

from collections.abc import Sequence

from services.common.block_hash import NO_PARENT, extend_block_hashes
from services.engine.request import Request
from services.engine.scheduler.block_pool import BlockPool
from services.engine.scheduler.kv_events import KvEventLog

# A table's "already cached" mark past any length: its blocks are never published.
_NEVER_CACHED = 1 << 62


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int,
                 events: KvEventLog | None = None) -> None:
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        self.block_size = block_size
        self.pool = BlockPool(num_blocks, events)
        self._tables: dict[str, list[int]] = {}
        self._num_cached: dict[str, int] = {}
        """Leading blocks of each table that the pool already knows by hash."""

    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

    @property
    def capacity_tokens(self) -> int:
        return self.pool.num_blocks * self.block_size

    @property
    def usage(self) -> float:
        return self.pool.usage

    def blocks_needed(self, num_tokens: int) -> int:
        return cdiv(num_tokens, self.block_size)

    def block_ids(self, request_id: str) -> Sequence[int]:
        return self._tables.get(request_id, ())

    def find_cached_prefix(self, request: Request) -> list[int]:
        """The cached blocks that hold the request's longest cached prefix.

        Capped below the request's length: its last token must still be computed,
        because sampling needs that token's logits.
        """
        self._hash_up_to(request, request.num_tokens)
        blocks = []
        for block_hash in request.block_hashes[:self._reusable_blocks(request)]:
            block = self.pool.lookup(block_hash)
            if block is None:
                break
            blocks.append(block)
        return blocks

    def allocate_slots(
        self, request_id: str, num_tokens: int, cached_blocks: Sequence[int] = ()
    ) -> bool:
        """Make the request's table cover `num_tokens` tokens; False (and no change) if
        the pool lacks the blocks. `cached_blocks` (from find_cached_prefix) start a
        new table and are shared, not copied."""
        table = self._tables.get(request_id)
        if table is None:
            table = []
        elif cached_blocks:
            raise ValueError(f"request {request_id!r} already has blocks")
        missing = self.blocks_needed(num_tokens) - len(table) - len(cached_blocks)
        # Reviving a free cached block takes it off the free list too.
        num_revived = sum(1 for b in cached_blocks if self.pool.ref_count(b) == 0)
        if max(missing, 0) + num_revived > self.pool.num_free_blocks:
            return False
        if request_id not in self._tables:
            self.pool.touch(cached_blocks)
            table.extend(cached_blocks)
            self._tables[request_id] = table
            self._num_cached[request_id] = len(cached_blocks)
        if missing > 0:
            table.extend(self.pool.allocate(missing))
        return True

    def trim(self, request_id: str, num_tokens: int) -> None:
        """Free the request's blocks past its first `num_tokens` tokens (the slots of
        rejected draft tokens). They hold no computed token, so none is cached."""
        table = self._tables.get(request_id)
        if table is None:
            return
        keep = self.blocks_needed(num_tokens)  # cached blocks hold computed tokens only
        if keep < len(table):
            tail = table[keep:]
            del table[keep:]
            self.pool.free(reversed(tail))

    def cache_full_blocks(self, request: Request) -> None:
        """Publish the request's blocks that its computed tokens now fill."""
        rid = request.request_id
        table = self._tables.get(rid)
        if table is None:
            return
        num_full = min(request.num_computed_tokens // self.block_size, len(table))
        first = self._num_cached[rid]
        if num_full <= first:
            return
        self._hash_up_to(request, request.num_computed_tokens)
        hashes = request.block_hashes
        size = self.block_size
        for i in range(first, num_full):
            self.pool.cache(table[i], hashes[i], hashes[i - 1] if i else NO_PARENT,
                            request.token_slice(i * size, (i + 1) * size))
        self._num_cached[rid] = num_full

    def num_blocks_in(self, request: Request, start: int, hashes: set[bytes]) -> int:
        """How many of the request's blocks from block `start` on, in a row, have their
        hash in `hashes`; as far as find_cached_prefix (which hashed them) looks."""
        end = start
        limit = self._reusable_blocks(request)
        while end < limit and request.block_hashes[end] in hashes:
            end += 1
        return end - start

    def _reusable_blocks(self, request: Request) -> int:
        # The last token must still be computed: sampling needs its logits.
        return (request.num_tokens - 1) // self.block_size

    def uncached_hashes(self, request: Request) -> Sequence[bytes]:
        """The hashes of the request's full blocks, as far as it has been hashed, that
        it holds or will compute but has not cached yet; empty for a request without
        blocks."""
        first = self._num_cached.get(request.request_id)
        return () if first is None else request.block_hashes[first:]

    def free(self, request_id: str) -> None:
        table = self._tables.pop(request_id, None)
        self._num_cached.pop(request_id, None)
        if table:
            # Tail first: eviction then takes a request's last blocks before its first,
            # which are the ones most likely shared as a prefix.
            self.pool.free(reversed(table))

    def reset_prefix_cache(self) -> int:
        """Drop every cached block (none may be held); returns how many were dropped."""
        return self.pool.reset_cache()

    def invalidate_prefix_cache(self) -> int:
        """After a weight update: forget every cached block (held ones too) and keep the
        requests that hold blocks from publishing any more of theirs, whose KV mixes the
        old weights' with the new. Returns how many cached blocks were forgotten."""
        for request_id in self._tables:
            self._num_cached[request_id] = _NEVER_CACHED
        return self.pool.forget_hashes()

    def _hash_up_to(self, request: Request, num_tokens: int) -> None:
        extend_block_hashes(request.block_hashes, request.token_slice, num_tokens,
                            self.block_size, request.cache_salt)

    def check_integrity(self) -> None:
        """Every held block is referenced exactly as often as tables list it."""
        counts: dict[int, int] = {}
        for table in self._tables.values():
            for b in table:
                counts[b] = counts.get(b, 0) + 1
        for b in range(self.pool.num_blocks):
            if self.pool.ref_count(b) != counts.get(b, 0):
                raise AssertionError(f"block {b}: ref count {self.pool.ref_count(b)}, "
                                     f"held {counts.get(b, 0)} times")
        self.pool.check_integrity()
