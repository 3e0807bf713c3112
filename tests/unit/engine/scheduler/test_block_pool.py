"""BlockPool: reference counts, the LRU free list and the hash -> block map."""

from __future__ import annotations

import pytest

from services.engine.scheduler.block_pool import BlockPool
from tests.unit.engine.scheduler_helpers import h


def test_allocates_and_frees_with_ref_counts() -> None:
    pool = BlockPool(4)
    blocks = pool.allocate(3)
    assert len(set(blocks)) == 3
    assert pool.num_free_blocks == 1
    assert pool.usage == pytest.approx(0.75)
    pool.free(blocks)
    assert pool.num_free_blocks == 4
    with pytest.raises(ValueError, match="freed twice"):
        pool.free([blocks[0]])
    with pytest.raises(ValueError, match="5 blocks"):
        pool.allocate(5)
    pool.check_integrity()


def test_cached_free_blocks_are_evicted_least_recently_freed_first() -> None:
    pool = BlockPool(4)
    a, b, c, d = pool.allocate(4)
    for i, block in enumerate((a, b, c)):
        pool.cache(block, h(i))
    pool.free([c, a, b, d])
    assert pool.free_block_ids() == [c, a, b, d]
    # Free cached blocks still count as free, and still hit.
    assert pool.num_free_blocks == 4 and pool.lookup(h(0)) == a
    assert pool.allocate(2) == [c, a]
    assert pool.lookup(h(2)) is None and pool.lookup(h(0)) is None
    assert pool.lookup(h(1)) == b
    assert pool.num_cached_blocks == 1
    pool.check_integrity()


def test_touch_revives_a_free_cached_block_from_the_middle_of_the_free_list() -> None:
    pool = BlockPool(3)
    blocks = pool.allocate(3)
    pool.cache(blocks[1], h(7))
    pool.free(blocks)
    pool.touch([blocks[1]])
    assert pool.ref_count(blocks[1]) == 1
    assert pool.free_block_ids() == [blocks[0], blocks[2]]
    # Shared by a second holder: it stays held until both let go.
    pool.touch([blocks[1]])
    pool.free([blocks[1]])
    assert pool.ref_count(blocks[1]) == 1 and pool.num_free_blocks == 2
    pool.free([blocks[1]])
    assert pool.free_block_ids() == [blocks[0], blocks[2], blocks[1]]
    # Revived blocks are never handed out as fresh ones while held.
    pool.touch([blocks[1]])
    assert blocks[1] not in pool.allocate(2)
    pool.check_integrity()


def test_duplicate_contents_keep_the_first_cached_block() -> None:
    pool = BlockPool(2)
    first, second = pool.allocate(2)
    pool.cache(first, h(1))
    pool.cache(second, h(1))
    assert pool.lookup(h(1)) == first
    assert pool.is_cached(first) and not pool.is_cached(second)
    pool.check_integrity()
