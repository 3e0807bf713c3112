"""The engines' prefix-cache events as vLLM's KvEventBatch stream."""

from __future__ import annotations

import asyncio
import hashlib
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import cast

import grpc
import pytest
from corestream.engine.v1 import engine_core_service_pb2 as engine_pb2
from corestream.vendor.smg_grpc_proto import common_pb2 as smg_pb2

from services.common.block_hash import hash_block
from services.frontend.errors import RequestError
from services.frontend.routing.engine_client import EngineClient
from services.frontend.vllm_grpc.kv_events import KvEventHub, block_hash_int64, to_vllm_events

BLOCK = 4


@dataclass
class _Engine:
    address: str
    engine_index: int | None
    name: str = "engine"


def engine(address: str = "a", rank: int | None = 0) -> EngineClient:
    return cast(EngineClient, _Engine(address, rank))


def stored(seq: int, block: bytes, parent: bytes = b"", tokens: tuple[int, ...] = (1, 2, 3, 4)
           ) -> engine_pb2.KvCacheEvent:
    return engine_pb2.KvCacheEvent(seq=seq, stored=engine_pb2.BlockStored(
        block_hash=block, parent_hash=parent, token_ids=tokens))


def removed(seq: int, block: bytes) -> engine_pb2.KvCacheEvent:
    return engine_pb2.KvCacheEvent(seq=seq, removed=engine_pb2.BlockRemoved(block_hash=block))


def cleared(seq: int) -> engine_pb2.KvCacheEvent:
    return engine_pb2.KvCacheEvent(seq=seq, cleared=engine_pb2.CacheCleared())


def snapshot(epoch: str = "e1", seq: int = 0) -> engine_pb2.SessionResponse:
    return engine_pb2.SessionResponse(kv_cache_snapshot=engine_pb2.KvCacheSnapshot(
        epoch=epoch, seq=seq, block_size=BLOCK))


def events(*items: engine_pb2.KvCacheEvent, running: int = 1) -> engine_pb2.SessionResponse:
    return engine_pb2.SessionResponse(
        kv_cache_events=items, timestamp=123.0,
        scheduler_stats=engine_pb2.SchedulerStats(num_running=running, num_waiting=2,
                                                  kv_cache_usage=0.25))


A = hash_block(None, [1, 2, 3, 4])
B = hash_block(A, [5, 6, 7, 8])
C = hash_block(B, [9, 10, 11, 12])
D = hash_block(None, [13, 14, 15, 16])


def test_hash_is_the_digests_first_eight_bytes_signed() -> None:
    digest = hashlib.sha256(b"x").digest()
    assert block_hash_int64(digest) == int.from_bytes(digest[:8], "big", signed=True)
    assert block_hash_int64(b"\xff" * 32) == -1
    assert block_hash_int64(b"\x7f" + b"\xff" * 31) == (1 << 63) - 1


def test_a_chain_of_stores_is_one_event_and_other_kinds_break_it() -> None:
    out = to_vllm_events([stored(1, A), stored(2, B, A, (5, 6, 7, 8)), stored(3, C, B),
                          stored(4, D), removed(5, A), removed(6, B), cleared(7), stored(8, A)],
                         BLOCK)
    assert [e.WhichOneof("data") for e in out] == ["stored", "stored", "removed", "cleared",
                                                    "stored"]
    chain = out[0]
    assert chain.event_id == 1
    assert [b.block_hash for b in chain.stored.blocks] == [
        block_hash_int64(A), block_hash_int64(B), block_hash_int64(C)]
    assert list(chain.stored.blocks[1].token_ids) == [5, 6, 7, 8]
    assert {b.block_size for b in chain.stored.blocks} == {BLOCK}
    assert not chain.stored.HasField("parent_block_hash")  # a first block
    assert chain.stored.tier == smg_pb2.KV_CACHE_TIER_DEVICE
    assert out[1].event_id == 4  # D starts a new chain
    assert list(out[2].removed.block_hashes) == [block_hash_int64(A), block_hash_int64(B)]


def test_a_chain_that_continues_an_older_block_names_its_parent() -> None:
    (event,) = to_vllm_events([stored(9, C, B)], BLOCK)
    assert event.stored.parent_block_hash == block_hash_int64(B)


def test_batches_are_numbered_from_one_with_rank_and_load() -> None:
    hub = KvEventHub()
    hub.on_session_response(engine(rank=3), snapshot())
    assert hub.last_sequence_number == 0  # a first snapshot tells subscribers nothing
    hub.on_session_response(engine(rank=3), events(stored(1, A)))
    hub.on_session_response(engine(rank=3), events(removed(2, A), running=0))
    first, second = _history(hub)
    assert (first.sequence_number, second.sequence_number) == (1, 2)
    assert first.dp_rank == 3 and first.timestamp == 123.0
    assert (first.load.running_requests, first.load.waiting_requests,
            first.load.token_usage, first.load.sample) == (1, 2, 0.25, 1)
    assert hub.block_sizes() == {BLOCK}


def test_a_session_that_resumes_where_it_left_off_changes_nothing() -> None:
    hub = KvEventHub()
    hub.on_session_response(engine(), snapshot())
    hub.on_session_response(engine(), events(stored(1, A)))
    hub.on_session_response(engine(), snapshot("e1", seq=1))
    assert hub.last_sequence_number == 1


@pytest.mark.parametrize("resumed", [snapshot("e2", seq=0), snapshot("e1", seq=5)])
def test_a_restarted_engine_or_missed_events_clear_its_rank(
        resumed: engine_pb2.SessionResponse) -> None:
    hub = KvEventHub()
    hub.on_session_response(engine(rank=1), snapshot())
    hub.on_session_response(engine(rank=1), events(stored(1, A)))
    hub.on_session_response(engine(rank=1), resumed)
    latest = _history(hub)[-1]
    assert latest.dp_rank == 1
    assert [e.WhichOneof("data") for e in latest.events] == ["cleared"]


def test_a_hole_in_the_events_clears_the_rank_first() -> None:
    hub = KvEventHub()
    hub.on_session_response(engine(), snapshot())
    hub.on_session_response(engine(), events(stored(3, A)))
    (batch,) = _history(hub)
    assert [e.WhichOneof("data") for e in batch.events] == ["cleared", "stored"]


def test_events_of_an_engine_without_a_snapshot_are_dropped() -> None:
    hub = KvEventHub()
    hub.on_session_response(engine(), events(stored(1, A)))
    assert hub.last_sequence_number == 0


def test_a_translation_bug_does_not_reach_the_session() -> None:
    hub = KvEventHub()
    hub.on_session_response(engine(), snapshot())
    broken = engine_pb2.SessionResponse(kv_cache_events=[stored(1, A)])
    hub._engines["a"] = None  # type: ignore[assignment]
    hub.on_session_response(engine(), broken)  # logged, not raised


def test_subscribers_get_live_batches_or_resume_from_the_history() -> None:
    async def body() -> None:
        hub = KvEventHub(history=3)
        hub.on_session_response(engine(), snapshot())
        for seq, block in enumerate((A, B, C, D), start=1):
            hub.on_session_response(engine(), events(stored(seq, block)))
        live = hub.subscribe(0)
        resumed = hub.subscribe(3)
        stale = hub.subscribe(1)  # older than the history: from its oldest batch
        ahead = hub.subscribe(99)
        pending = [asyncio.ensure_future(anext(s)) for s in (live, resumed, stale, ahead)]
        await asyncio.sleep(0)
        hub.on_session_response(engine(), events(removed(5, A)))
        got = [(await p).sequence_number for p in pending]
        assert got == [5, 3, 2, 5]
        assert [(await anext(resumed)).sequence_number for _ in range(2)] == [4, 5]
        for stream in (live, resumed, stale, ahead):
            await stream.aclose()
        assert hub.num_subscribers == 0

    asyncio.run(body())


def test_a_subscriber_that_falls_behind_gets_what_was_queued_then_an_error() -> None:
    async def body() -> None:
        hub = KvEventHub(queue_size=2)
        hub.on_session_response(engine(), snapshot())
        stream = hub.subscribe(0)
        first = asyncio.ensure_future(anext(stream))
        await asyncio.sleep(0)
        for seq, block in enumerate((A, B, C, D), start=1):
            hub.on_session_response(engine(), events(stored(seq, block)))
        received = [(await first).sequence_number]
        with pytest.raises(RequestError) as info:
            async for batch in stream:
                received.append(batch.sequence_number)
        assert info.value.code is grpc.StatusCode.RESOURCE_EXHAUSTED
        assert received == [1, 2]  # consecutive up to the end, no hole
        assert hub.num_subscribers == 0

    asyncio.run(body())


def _history(hub: KvEventHub) -> list[smg_pb2.KvEventBatch]:
    async def collect() -> list[smg_pb2.KvEventBatch]:
        stream: AsyncIterator[smg_pb2.KvEventBatch] = hub.subscribe(1)
        out = []
        for _ in range(hub.last_sequence_number):
            out.append(await anext(stream))
        await stream.aclose()  # type: ignore[attr-defined]
        return out

    return asyncio.run(collect())
