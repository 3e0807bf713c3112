"""Prefix-cache events: recorded by the block pool, carried by the busy loop, routed
to subscribed Sessions only, and sufficient to mirror the engine's cache exactly."""

from __future__ import annotations

import queue
import random
from collections.abc import Callable, Iterable

import grpc
import pytest
from corestream.engine.v1 import engine_core_service_pb2 as pb

from services.common.block_hash import NO_PARENT, BlockHash
from services.common.sampling import SamplingParams
from services.engine.config import EngineConfig
from services.engine.core.engine_core import EngineCore
from services.engine.messages import KvSnapshot, SessionItem, SessionOutputs
from services.engine.request import Request
from services.engine.scheduler.block_pool import BlockPool
from services.engine.scheduler.kv_cache_manager import KVCacheManager
from services.engine.scheduler.kv_events import (
    BlockRemoved,
    BlockStored,
    CacheCleared,
    KvEvent,
    KvEventLog,
)
from services.engine.scheduler.scheduler import Scheduler
from services.engine.server import EngineServer
from tests.unit.engine.fakes import FakeRunner, SessionClient, collect, request
from tests.unit.engine.scheduler_helpers import compute, h, req, step


class Mirror:
    """What a frontend keeps: the snapshot, then every event replayed in seq order."""

    def __init__(self, seq: int, hashes: Iterable[BlockHash]) -> None:
        self.seq = seq
        self.hashes = set(hashes)

    def apply(self, events: Iterable[KvEvent]) -> None:
        for e in events:
            assert e.seq == self.seq + 1, f"event {e.seq} after {self.seq}: a gap or a repeat"
            self.seq = e.seq
            if isinstance(e, BlockStored):
                assert e.block_hash not in self.hashes
                self.hashes.add(e.block_hash)
            elif isinstance(e, BlockRemoved):
                self.hashes.remove(e.block_hash)
            else:
                self.hashes.clear()


# ---- the block pool and the KV cache manager ------------------------------------------

def test_pool_records_new_stores_evictions_and_resets_with_consecutive_seqs() -> None:
    log = KvEventLog()
    pool = BlockPool(3, log)
    a, b, c = pool.allocate(3)
    pool.cache(a, h(0))
    pool.cache(b, h(1), parent_hash=h(0))
    pool.cache(c, h(0))  # the same contents computed twice: c stays private
    pool.cache(a, h(0))  # already cached
    assert log.drain() == (BlockStored(1, h(0), NO_PARENT), BlockStored(2, h(1), h(0)))
    assert sorted(pool.cached_hashes()) == [h(0), h(1)]

    pool.free([c, b, a])
    assert pool.allocate(2) == [c, b]  # c was never cached: only b is an eviction
    assert log.drain() == (BlockRemoved(3, h(1)),)
    pool.free([c, b])
    assert pool.reset_cache() == 1
    assert log.drain() == (CacheCleared(4),)
    pool.allocate(3)  # a is no longer cached: reusing it removes nothing
    assert log.drain() == () and log.last_seq == 4 and pool.cached_hashes() == []


def test_epochs_differ_between_logs() -> None:
    assert KvEventLog().epoch != KvEventLog().epoch


def test_manager_names_each_stored_block_by_its_parent() -> None:
    log = KvEventLog()
    kv = KVCacheManager(num_blocks=8, block_size=4, events=log)
    r = req("r", list(range(1, 14)))
    compute(kv, r)
    events = log.drain()
    assert [e.block_hash for e in events if isinstance(e, BlockStored)] == r.block_hashes[:3]
    assert [e.parent_hash for e in events if isinstance(e, BlockStored)] == [
        NO_PARENT, *r.block_hashes[:2]]


def test_stored_blocks_carry_their_own_token_ids_prompt_and_output() -> None:
    log = KvEventLog()
    kv = KVCacheManager(num_blocks=8, block_size=4, events=log)
    r = req("r", list(range(1, 7)), max_tokens=8)
    compute(kv, r)  # 6 prompt tokens: one full block
    r.output_token_ids.extend([50, 51, 52])
    r.num_computed_tokens = r.num_tokens - 1  # the last sampled token is not computed yet
    assert kv.allocate_slots(r.request_id, r.num_tokens, [])
    kv.cache_full_blocks(r)  # the second block: two prompt tokens and two outputs
    stored = [e for e in log.drain() if isinstance(e, BlockStored)]
    assert [e.token_ids for e in stored] == [(1, 2, 3, 4), (5, 6, 50, 51)]
    assert stored[1].block_hash == r.block_hashes[1]


def test_mirror_replays_to_the_pool_through_a_random_workload_with_evictions() -> None:
    rng = random.Random(7)
    log = KvEventLog()
    s = Scheduler(KVCacheManager(num_blocks=12, block_size=4, events=log), max_model_len=48,
                  max_num_seqs=4, max_num_batched_tokens=16, policy="fcfs")
    pool = s.kv_cache.pool
    prefixes = [[rng.randrange(1, 1000) for _ in range(8)] for _ in range(3)]
    mirror = Mirror(log.last_seq, pool.cached_hashes())
    late: Mirror | None = None
    counts = {BlockStored: 0, BlockRemoved: 0, CacheCleared: 0}
    for i in range(800):
        if rng.random() < 0.3 and len(s.waiting) < 4:
            prompt = (rng.choice(prefixes)[:rng.randrange(0, 9)]
                      + [rng.randrange(1, 1000) for _ in range(rng.randrange(1, 12))])
            s.add_request(Request(f"r{i}", prompt, SamplingParams(
                temperature=0.0, max_tokens=rng.randrange(1, 10)), eos_token_ids=(0,)))
        if s.has_work():
            step(s)
        elif rng.random() < 0.05:
            s.kv_cache.reset_prefix_cache()
        events = log.drain()
        for e in events:
            counts[type(e)] += 1
        mirror.apply(events)
        assert mirror.hashes == set(pool.cached_hashes()), f"step {i}"
        if late is not None:
            late.apply(events)
            assert late.hashes == mirror.hashes
        elif i == 400:  # a second subscriber joins mid-way, between two drains
            late = Mirror(log.last_seq, pool.cached_hashes())
    assert counts[BlockRemoved] > 50 and counts[CacheCleared] >= 1, counts


# ---- the busy loop, in each of its step paths -------------------------------------------

class SoloWaveRunner(FakeRunner):
    """A one-rank expert-parallel group: dummies are free and the vote is its own."""

    def execute_dummy(self) -> None:
        pass

    def any_rank_has_work(self, has_work: bool) -> bool:
        return has_work


def make_core(path: str) -> EngineCore:
    if path == "wave":
        core = EngineCore(EngineConfig(), SoloWaveRunner(num_blocks=10))
        core.join_waves(check_interval=2)
        return core
    depth = 2 if path == "batch_queue" else 1
    return EngineCore(EngineConfig(max_concurrent_batches=depth), FakeRunner(num_blocks=10))


def next_snapshot(q: queue.Queue[SessionItem]) -> KvSnapshot:
    item = q.get(timeout=10)
    assert isinstance(item, KvSnapshot)
    return item


def follow(q: queue.Queue[SessionItem], mirror: Mirror, seq: int) -> None:
    """Replay a subscriber's queue up to event `seq`; it has no requests of its own."""
    while mirror.seq < seq:
        item = q.get(timeout=10)
        assert isinstance(item, SessionOutputs) and not item.updates and item.kv_events
        mirror.apply(item.kv_events)


@pytest.mark.timeout(30)
@pytest.mark.parametrize("path", ["plain", "batch_queue", "wave"])
def test_subscriber_mirrors_the_cache_in_every_step_path(path: str) -> None:
    core = make_core(path)
    sub, other = core.sessions.open("sub"), core.sessions.open("other")
    sunk: list[KvEvent] = []  # what the vLLM-format publisher would be handed
    core.outputs.add_kv_sink(sunk.extend)
    core.start()
    try:
        core.subscribe_kv_events("sub")  # the loop is idle: the subscription wakes it
        snap = next_snapshot(sub)
        assert (snap.epoch, snap.seq, snap.block_size, snap.block_hashes) == (
            core.kv_events.epoch, 0, 4, [])
        mirror = Mirror(snap.seq, snap.block_hashes)
        for wave in range(3):  # 10 blocks: later waves evict earlier ones' blocks
            ids = {f"w{wave}r{i}" for i in range(3)}
            for i, rid in enumerate(sorted(ids)):
                prompt = tuple(range(1 + 20 * i + wave, 14 + 20 * i + wave))
                core.add_request(request(rid, session="other", prompt=prompt, max_tokens=5))
            _, messages = collect(other, ids)
            assert not any(m.kv_events for m in messages)  # "other" never subscribed
        # A late subscriber's snapshot marks where the first one must have got to.
        late = core.sessions.open("late")
        core.subscribe_kv_events("late")
        last = next_snapshot(late)
        follow(sub, mirror, last.seq)
        assert mirror.hashes == set(last.block_hashes) == set(
            core.scheduler.kv_cache.pool.cached_hashes())
        assert mirror.seq > len(mirror.hashes)  # blocks were evicted along the way
        # A sink gets every event once, in order, whether or not a Session subscribed.
        sunk_mirror = Mirror(0, [])
        sunk_mirror.apply(e for e in sunk if e.seq <= last.seq)
        assert sunk_mirror.hashes == mirror.hashes
        assert all(len(e.token_ids) == 4 for e in sunk if isinstance(e, BlockStored))
    finally:
        core.shutdown()


# ---- end to end, through EngineCoreService ---------------------------------------------

@pytest.fixture
def runner() -> FakeRunner:
    """What conftest's `server` serves here: a small cache, so requests evict."""
    return FakeRunner(num_blocks=16)


def event_from_proto(e: pb.KvCacheEvent) -> KvEvent:
    kind = e.WhichOneof("kind")
    if kind == "stored":
        return BlockStored(e.seq, e.stored.block_hash, e.stored.parent_hash,
                           tuple(e.stored.token_ids))
    if kind == "removed":
        return BlockRemoved(e.seq, e.removed.block_hash)
    assert kind == "cleared"
    return CacheCleared(e.seq)


def subscribe(channel: grpc.Channel) -> tuple[SessionClient, pb.KvCacheSnapshot]:
    client = SessionClient(channel, kv_cache_events=True)
    first = next(client.responses)
    assert first.HasField("kv_cache_snapshot") and not first.outputs
    return client, first.kv_cache_snapshot


def read(client: SessionClient, mirror: Mirror,
         until: Callable[[pb.SessionResponse], bool]) -> list[pb.SessionResponse]:
    messages = []
    for msg in client.responses:
        messages.append(msg)
        mirror.apply(event_from_proto(e) for e in msg.kv_cache_events)
        if until(msg):
            return messages
    raise AssertionError("the Session ended early")


def barrier(client: SessionClient, mirror: Mirror, call_id: int,
            method: str = "get_stats") -> list[pb.SessionResponse]:
    """A utility call's reply follows every output queued before it."""
    client.send(pb.SessionRequest(utility=pb.UtilityCall(call_id=call_id, method=method)))
    return read(client, mirror, lambda m: m.utility_result.call_id == call_id)


def assert_unsubscribed(messages: list[pb.SessionResponse]) -> None:
    assert all(m.outputs for m in messages)  # no kv-only messages
    assert not any(m.kv_cache_events or m.HasField("kv_cache_snapshot") for m in messages)


@pytest.mark.timeout(60)
def test_subscribers_mirror_the_engine_cache_and_others_see_nothing(
        channel: grpc.Channel, server: EngineServer) -> None:
    pool = server.core.scheduler.kv_cache.pool
    a, snap = subscribe(channel)
    assert (snap.epoch, snap.seq, snap.block_size, list(snap.block_hashes)) == (
        server.core.kv_events.epoch, 0, 4, [])
    mirror_a = Mirror(snap.seq, snap.block_hashes)
    rng = random.Random(3)
    pending = {f"a{r}" for r in range(8)}
    for rid in sorted(pending):  # 16 blocks for 8 requests of 4 blocks: evictions
        a.add(rid, [rng.randrange(3, 90) for _ in range(11)], max_tokens=5)

    def all_finished(m: pb.SessionResponse) -> bool:
        pending.difference_update(o.request_id for o in m.outputs if o.finish_reason)
        return not pending

    messages = read(a, mirror_a, all_finished)  # the last step's events come with its outputs
    assert mirror_a.hashes == set(pool.cached_hashes())
    stored = [e.stored for m in messages for e in m.kv_cache_events if e.HasField("stored")]
    assert stored and all(len(e.token_ids) == 4 for e in stored)
    assert mirror_a.seq > len(mirror_a.hashes)  # some were removed again

    b, snap_b = subscribe(channel)  # joins an idle engine later
    assert snap_b.epoch == snap.epoch and snap_b.seq == mirror_a.seq
    assert set(snap_b.block_hashes) == mirror_a.hashes
    mirror_b = Mirror(snap_b.seq, snap_b.block_hashes)

    c = SessionClient(channel)
    c.add("c0", list(range(30, 45)), max_tokens=3)
    _, messages = c.collect({"c0"})
    assert_unsubscribed(messages)
    for client, mirror in ((a, mirror_a), (b, mirror_b)):
        # Events of c0's steps reach the subscribers, in messages of their own.
        kv_only = barrier(client, mirror, 3)[:-1]
        assert kv_only and all(m.kv_cache_events and not m.outputs for m in kv_only)
    assert mirror_a.seq == mirror_b.seq == server.core.kv_events.last_seq
    assert mirror_a.hashes == mirror_b.hashes == set(pool.cached_hashes())

    reply = barrier(a, mirror_a, 4, "reset_prefix_cache")[-1].utility_result
    assert not reply.failure_message
    for client, mirror in ((a, mirror_a), (b, mirror_b)):
        read(client, mirror, lambda m: any(e.HasField("cleared") for e in m.kv_cache_events))
        assert mirror.hashes == set() and mirror.seq == server.core.kv_events.last_seq
    c.add("c1", list(range(50, 60)), max_tokens=2)  # after the reset: no cleared for c
    _, messages = c.collect({"c1"})
    assert_unsubscribed(messages)
    for client in (a, b, c):
        client.close()
