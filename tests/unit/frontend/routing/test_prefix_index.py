"""The frontend's prefix index and routing cost, and the hash it shares with engines."""

from __future__ import annotations

import random

import pytest

from services.common.block_hash import prompt_block_hashes
from services.common.sampling import SamplingParams
from services.engine.request import Request
from services.engine.scheduler.kv_cache_manager import KVCacheManager
from services.frontend.routing.policies import Option, cache_aware, least_load
from services.frontend.routing.prefix_index import PrefixIndex

BS = 4


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def _hashes(tokens: list[int], salt: str = "") -> list[bytes]:
    return prompt_block_hashes(tokens, BS, salt)


@pytest.mark.parametrize("salt", ["", "tenant-7"])
@pytest.mark.parametrize("length", [1, 4, 5, 16, 17, 63])
def test_frontend_hashes_equal_the_engines(salt: str, length: int) -> None:
    tokens = random.Random(length).choices(range(1000), k=length)
    engine = KVCacheManager(num_blocks=64, block_size=BS)
    request = Request("r", list(tokens), SamplingParams(max_tokens=1), cache_salt=salt)
    engine.find_cached_prefix(request)  # hashes the request as admission does
    usable = (length - 1) // BS  # the blocks an engine may serve from its cache
    assert _hashes(tokens, salt) == request.block_hashes[:usable]
    assert len(_hashes(tokens, salt)) == usable
    if usable:
        assert _hashes(tokens, salt + "x")[0] != _hashes(tokens, salt)[0]


def test_match_counts_each_engines_leading_blocks() -> None:
    index = PrefixIndex()
    prompt = list(range(33))  # 8 usable blocks
    hashes = _hashes(prompt)
    index.apply_snapshot("a", "ea", 10, BS, hashes[:6])
    index.apply_snapshot("b", "eb", 0, BS, hashes[:2] + hashes[3:])  # a hole at block 2
    assert index.match(hashes, ["a", "b", "c"]) == {"a": 6, "b": 2, "c": 0}
    assert index.match(_hashes(prompt, "salt"), ["a", "b"]) == {"a": 0, "b": 0}


def test_events_follow_the_sequence_and_a_gap_is_refused() -> None:
    index = PrefixIndex()
    hashes = _hashes(list(range(17)))
    index.apply_snapshot("a", "e1", 5, BS, [])
    assert index.stored("a", 6, hashes[0]) and index.stored("a", 7, hashes[1])
    assert index.match(hashes, ["a"]) == {"a": 2}
    assert not index.stored("a", 9, hashes[2])  # 8 was lost
    assert index.match(hashes, ["a"]) == {"a": 2}
    assert index.removed("a", 8, hashes[0])
    assert index.match(hashes, ["a"]) == {"a": 0}
    assert index.cleared("a", 9) and len(index) == 0 and index.tracks("a")
    assert not index.stored("b", 1, hashes[0])  # not followed: no snapshot yet
    # A new snapshot (a reconnect, or a restarted engine's new epoch) replaces all.
    index.apply_snapshot("a", "e2", 0, BS, hashes[:3])
    assert index.match(hashes, ["a"]) == {"a": 3}
    index.drop_engine("a")
    assert len(index) == 0 and not index.tracks("a")


def test_predictions_count_until_they_expire_unless_confirmed() -> None:
    clock = Clock()
    index = PrefixIndex(prediction_ttl_s=10, clock=clock)
    hashes = _hashes(list(range(17)))
    index.apply_snapshot("a", "e", 0, BS, [])
    index.predict("a", hashes)
    assert index.match(hashes, ["a"]) == {"a": 4}
    assert index.stored("a", 1, hashes[0])  # the engine confirms the first block
    clock.now += 11
    assert index.match(hashes, ["a"]) == {"a": 1}
    index.predict("a", hashes)  # a confirmed block is not downgraded to a prediction
    clock.now += 11
    assert index.match(hashes, ["a"]) == {"a": 1}
    index.predict("untracked", hashes)
    assert index.match(hashes, ["untracked"]) == {"untracked": 0}


def test_memory_is_bounded_least_recently_used_first() -> None:
    index = PrefixIndex(max_blocks=8)
    old, new = _hashes(list(range(25))), _hashes(list(range(1000, 1025)))
    index.apply_snapshot("a", "e", 0, BS, old)  # 6 blocks
    index.match(old[:2], ["a"])  # the first two are used again
    for seq, h in enumerate(new[:4], start=1):
        index.stored("a", seq, h)
    assert len(index) == 8
    assert index.match(old, ["a"]) == {"a": 2}  # blocks 2 and 3 went; 0 and 1 were fresh
    assert index.match(new, ["a"]) == {"a": 4}


def test_cost_follows_the_prefix_until_load_is_badly_imbalanced() -> None:
    # 1,100-token prompt; engine 0 holds 1,024 tokens.
    held, none = Option(load=6, cached_tokens=1024), Option(load=3)
    choice = cache_aware([held, none], 1100, prefill_tokens_per_request=64)
    assert choice.index == 0 and "holds 1024 of 1100" in choice.reason
    # Nobody holds anything: least load, as least_load would choose.
    assert cache_aware([Option(5), Option(2)], 1100, 64).index == 1
    assert least_load([Option(5), Option(2)]).index == 1
    # Far more loaded than 1.5 x 3 + 4: load wins whatever the cache.
    busy = Option(load=9, cached_tokens=1024)
    choice = cache_aware([busy, none], 1100, prefill_tokens_per_request=64)
    assert choice.index == 1 and "imbalance" in choice.reason
    # A short uncached remainder against a bigger load gap: load wins by cost.
    choice = cache_aware([Option(8, 64), Option(3)], 100, prefill_tokens_per_request=64)
    assert choice.index == 1 and "outweighs" in choice.reason
    # Ties go to the first (the balancer orders options to rotate).
    assert cache_aware([Option(1, 512), Option(1, 512)], 600, 64).index == 0
