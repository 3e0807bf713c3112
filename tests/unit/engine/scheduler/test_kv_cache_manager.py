"""KVCacheManager: block tables grown by whole blocks (prefix caching: test_prefix_cache.py)."""

from __future__ import annotations

from services.engine.scheduler.kv_cache_manager import KVCacheManager


def test_request_table_grows_by_whole_blocks() -> None:
    kv = KVCacheManager(num_blocks=4, block_size=4)
    assert kv.allocate_slots("a", 5)
    assert len(kv.block_ids("a")) == 2
    assert kv.allocate_slots("a", 8)  # still fits in two blocks
    assert len(kv.block_ids("a")) == 2
    assert kv.allocate_slots("a", 9)
    assert len(kv.block_ids("a")) == 3
    kv.check_integrity()


def test_failed_allocation_changes_nothing() -> None:
    kv = KVCacheManager(num_blocks=3, block_size=2)
    assert kv.allocate_slots("a", 4)
    assert not kv.allocate_slots("b", 4)
    assert kv.block_ids("b") == ()
    assert not kv.allocate_slots("a", 7)
    assert len(kv.block_ids("a")) == 2
    kv.check_integrity()


def test_free_returns_every_block() -> None:
    kv = KVCacheManager(num_blocks=4, block_size=2)
    kv.allocate_slots("a", 3)
    kv.allocate_slots("b", 4)
    kv.free("a")
    kv.free("a")  # idempotent: finishing and aborting can race
    assert kv.num_free_blocks == 2
    kv.free("b")
    assert kv.num_free_blocks == 4
    assert kv.usage == 0.0
    kv.check_integrity()
