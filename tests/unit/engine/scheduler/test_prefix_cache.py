"""Prefix caching: chained block hashes, longest-prefix lookup, and the scheduler
reusing cached blocks (including a preempted request's own), with its stats."""

from __future__ import annotations

import pytest

from services.common.block_hash import extend_block_hashes, hash_block
from services.engine.scheduler.kv_cache_manager import KVCacheManager
from services.engine.scheduler.scheduler import Scheduler
from tests.unit.engine.scheduler_helpers import (
    compute,
    make_scheduler,
    req,
    run_to_completion,
    step,
)


def hashes(tokens: list[int], block_size: int = 4, salt: str = "") -> list[bytes]:
    out: list[bytes] = []
    extend_block_hashes(out, lambda a, b: tokens[a:b], len(tokens), block_size, salt)
    return out


# ---- hashes ----------------------------------------------------------------------

def test_only_full_blocks_are_hashed_and_hashes_are_deterministic() -> None:
    tokens = list(range(1, 11))
    assert len(hashes(tokens)) == 2
    assert hashes(tokens) == hashes(tokens)
    assert hashes(tokens)[0] == hash_block(None, tokens[:4])


def test_salt_separates_identical_tokens() -> None:
    tokens = list(range(1, 9))
    plain, salted, other = hashes(tokens), hashes(tokens, salt="t1"), hashes(tokens, salt="t2")
    assert not set(plain) & set(salted) and not set(salted) & set(other)


def test_an_early_difference_changes_every_later_block() -> None:
    a = list(range(1, 13))
    b = [99, *a[1:]]
    ha, hb = hashes(a), hashes(b)
    assert all(x != y for x, y in zip(ha, hb, strict=True))
    c = [*a[:4], 99, *a[5:]]
    hc = hashes(c)
    assert hc[0] == ha[0] and hc[1] != ha[1] and hc[2] != ha[2]


# ---- lookup in the KV cache manager ----------------------------------------------

def test_lookup_finds_the_longest_cached_prefix() -> None:
    kv = KVCacheManager(num_blocks=16, block_size=4)
    a = req("a", list(range(1, 14)))  # 3 full blocks + 1 token
    compute(kv, a)
    table = list(kv.block_ids("a"))
    assert kv.find_cached_prefix(req("b", [*range(1, 9), 50, 51, 52, 53, 54])) == table[:2]
    assert kv.find_cached_prefix(req("c", [*range(1, 6), 50, 51, 52, 53])) == table[:1]
    assert kv.find_cached_prefix(req("d", [50, *range(2, 14)])) == []
    assert kv.find_cached_prefix(req("e", list(range(1, 14)), salt="x")) == []


def test_a_whole_prompt_hit_still_leaves_the_last_token_to_compute() -> None:
    kv = KVCacheManager(num_blocks=16, block_size=4)
    compute(kv, req("a", list(range(1, 13))))
    # The same 12 tokens: 3 cached blocks, but only 2 may be used (11 // 4).
    assert len(kv.find_cached_prefix(req("b", list(range(1, 13))))) == 2
    assert len(kv.find_cached_prefix(req("c", list(range(1, 14))))) == 3


def test_shared_blocks_are_counted_once_and_survive_their_first_owner() -> None:
    kv = KVCacheManager(num_blocks=6, block_size=4)
    compute(kv, req("a", list(range(1, 10))))
    b = req("b", [*range(1, 9), 70, 71])
    cached = kv.find_cached_prefix(b)
    assert kv.allocate_slots("b", b.num_tokens, cached)
    assert kv.num_free_blocks == 6 - 3 - 1
    kv.free("a")
    assert list(kv.block_ids("b"))[:2] == cached
    kv.check_integrity()
    kv.free("b")
    assert kv.num_free_blocks == 6
    kv.check_integrity()


def test_evicted_blocks_no_longer_hit() -> None:
    kv = KVCacheManager(num_blocks=3, block_size=4)
    compute(kv, req("a", list(range(1, 10))))
    kv.free("a")
    compute(kv, req("b", list(range(50, 59))))  # needs all 3 blocks: evicts a's
    assert kv.find_cached_prefix(req("a2", list(range(1, 10)))) == []
    kv.check_integrity()


# ---- the scheduler ---------------------------------------------------------------

def test_second_request_computes_only_past_the_shared_prefix() -> None:
    s = make_scheduler(num_blocks=32, block_size=4)
    shared = list(range(1, 17))
    s.add_request(req("a", [*shared, 100, 101]))
    run_to_completion(s)
    s.add_request(req("b", [*shared, 200, 201, 202]))
    out, ups = step(s)
    [sr] = out.requests
    assert (sr.start_pos, list(sr.token_ids)) == (16, [200, 201, 202])
    assert ups[0].num_cached_tokens == 16 and s.requests["b"].num_cached_tokens == 16
    stats = s.stats()
    assert (stats.prefix_cache_queries, stats.prefix_cache_hits) == (18 + 19, 16)
    # b's prefix blocks are a's cached blocks, not copies: a's 21 computed tokens
    # filled 5 blocks and b has filled no new one yet.
    assert s.kv_cache.pool.num_cached_blocks == 5


@pytest.mark.parametrize("policy", ["fcfs", "priority"])
def test_requests_sharing_a_new_prefix_wait_for_its_first_computation(policy: str) -> None:
    # b and c arrive with a (a 32-token shared prefix nobody holds yet); d shares
    # nothing. b and c wait while a computes the prefix, d overtakes them, and then
    # both start on a's cached blocks instead of computing the prefix again.
    s = make_scheduler(num_blocks=64, block_size=4, max_num_batched_tokens=20, policy=policy)
    s.wait_for_prefix_tokens = 8
    shared = list(range(1, 33))
    s.add_request(req("a", [*shared, 100]))
    s.add_request(req("b", [*shared, 200, 201]))
    s.add_request(req("c", [*shared, 300]))
    s.add_request(req("d", [500, 501]))
    out, _ = step(s)  # a's first chunk of 20 (the budget)
    assert [(r.request_id, r.start_pos) for r in out.requests] == [("a", 0)]
    # a's last 13 tokens; b and c would share 12 of them (3 blocks), so they wait,
    # and d fits the rest of the budget.
    out, _ = step(s)
    assert [(r.request_id, r.start_pos) for r in out.requests] == [("a", 20), ("d", 0)]
    assert list(s.waiting) == [s.requests["b"], s.requests["c"]]  # their order kept
    assert s.num_prefix_waits == 2
    out, ups = step(s)
    started = {r.request_id: (r.start_pos, len(r.token_ids)) for r in out.requests}
    assert started["b"] == (32, 2) and started["c"] == (32, 1)
    assert {u.request_id: u.num_cached_tokens for u in ups if u.request_id in "bc"} == {
        "b": 32, "c": 32}
    run_to_completion(s)
    s.kv_cache.check_integrity()


def test_a_short_shared_run_is_not_waited_for() -> None:
    # b's only in-progress shared block (4 tokens) is below the threshold of 8: b
    # computes it itself, beside a, rather than wait a step.
    s = make_scheduler(num_blocks=64, block_size=4)
    s.wait_for_prefix_tokens = 8
    s.add_request(req("a", [1, 2, 3, 4, 5]))
    s.add_request(req("b", [1, 2, 3, 4, 6]))
    s.add_request(req("c", [7, 8, 9, 10, 11, 12, 13, 14, 15]))
    s.add_request(req("d", [7, 8, 9, 10, 11, 12, 13, 14, 16]))
    out, _ = step(s)
    assert [r.request_id for r in out.requests] == ["a", "b", "c"]  # d waits for 2 blocks
    assert s.num_prefix_waits == 1


def test_different_salts_do_not_share() -> None:
    s = make_scheduler(num_blocks=32, block_size=4)
    prompt = list(range(1, 18))
    s.add_request(req("a", prompt, salt="tenant-1"))
    run_to_completion(s)
    s.add_request(req("b", prompt, salt="tenant-2"))
    s.add_request(req("c", prompt, salt="tenant-1"))
    out, _ = step(s)
    assert [(r.request_id, r.start_pos) for r in out.requests] == [("b", 0), ("c", 16)]


def test_generated_tokens_blocks_are_cached_as_they_fill() -> None:
    s = make_scheduler(num_blocks=32, block_size=4)
    s.add_request(req("a", [1, 2, 3], max_tokens=7))
    results = run_to_completion(s)
    outputs = [t for u in results["a"] for t in u.new_token_ids]
    assert outputs == [4, 5, 6, 7, 8, 9, 10]
    # Tokens 1..8 were fed through the model (10 was sampled last, 9 was computed),
    # so blocks [1-4] and [5-8] are cached; a follow-up turn reuses both.
    s.add_request(req("b", [*range(1, 10), 42]))
    out, _ = step(s)
    assert out.requests[0].start_pos == 8


def test_preempted_request_resumes_on_its_own_cached_blocks() -> None:
    # 7 blocks of 4: a and b (disjoint prompts of 8) take 2 each and grow by decoding.
    s = make_scheduler(num_blocks=7, block_size=4, max_num_batched_tokens=64)
    s.add_request(req("a", list(range(1, 9)), max_tokens=12))
    s.add_request(req("b", list(range(101, 109)), max_tokens=12))
    b = s.requests["b"]
    b_blocks: list[int] = []
    resumed_at = None
    for _ in range(100):
        if not s.has_work():
            break
        out, _ = step(s)
        if b.num_preemptions == 0 and b in s.running:
            b_blocks = list(s.kv_cache.block_ids("b"))
        if resumed_at is None and b.num_preemptions and b in s.running:
            sr = next(r for r in out.requests if r.request_id == "b")
            resumed_at = sr.start_pos
            assert list(s.kv_cache.block_ids("b"))[: sr.start_pos // 4] == b_blocks[
                : sr.start_pos // 4]
        s.kv_cache.check_integrity()
    assert b.num_preemptions >= 1 and b.is_finished
    assert resumed_at is not None and resumed_at >= 8  # at least its whole prompt was reused
    assert b.output_token_ids == list(range(109, 121))
    assert s.prefix_cache_hits >= resumed_at
    # The first admission found nothing; that is what the client hears about.
    assert b.num_cached_tokens == 0


def test_stats_flow_into_scheduler_stats() -> None:
    s: Scheduler = make_scheduler(block_size=4)
    assert (s.stats().prefix_cache_queries, s.stats().prefix_cache_hits) == (0, 0)
    s.add_request(req("a", list(range(1, 10))))
    step(s)
    assert (s.stats().prefix_cache_queries, s.stats().prefix_cache_hits) == (9, 0)


def test_cache_salt_and_cached_tokens_cross_the_grpc_edge() -> None:
    from corestream.engine.v1 import engine_core_service_pb2 as pb

    from services.engine.request import RequestUpdate
    from services.engine.server import output_to_proto, request_from_proto

    add = pb.AddRequest(request_id="r", prompt_token_ids=[1, 2], cache_salt="tenant-1")
    assert request_from_proto(add, "s").cache_salt == "tenant-1"
    out = output_to_proto(RequestUpdate("r", "s", (3,), num_cached_tokens=16))
    assert out.num_cached_tokens == 16
