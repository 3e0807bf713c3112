"""KVCacheManager: each request's block table, grown as its tokens grow.

The scheduler asks for room before it schedules tokens (`allocate_slots`) and
gives everything back when a request finishes or is preempted (`free`). Blocks
come from a `BlockPool`; prefix caching will add a lookup of cached full blocks
by chained hash in front of the pool, without changing this interface.
"""

from __future__ import annotations

from collections.abc import Sequence

from services.engine.scheduler.block_pool import BlockPool


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int) -> None:
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        self.block_size = block_size
        self.pool = BlockPool(num_blocks)
        self._tables: dict[str, list[int]] = {}

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

    def allocate_slots(self, request_id: str, num_tokens: int) -> bool:
        """Make the request's table cover `num_tokens` tokens; False (and no change) if
        the pool lacks the blocks."""
        table = self._tables.setdefault(request_id, [])
        missing = self.blocks_needed(num_tokens) - len(table)
        if missing <= 0:
            return True
        if missing > self.pool.num_free_blocks:
            if not table:
                del self._tables[request_id]
            return False
        table.extend(self.pool.allocate(missing))
        return True

    def free(self, request_id: str) -> None:
        table = self._tables.pop(request_id, None)
        if table:
            # Reversed: the tail blocks are the least likely to be shared by a prefix later.
            self.pool.free(reversed(table))

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
        if self.pool.num_free_blocks != self.pool.num_blocks - len(counts):
            raise AssertionError("free list out of step with reference counts")
