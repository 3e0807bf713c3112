"""Every engine's prefix-cache events as vLLM's KvEventBatch stream (SubscribeKvEvents).

The engines already publish their caches on each frontend's Session (a snapshot, then
stored / removed / cleared events with consecutive seqs per engine epoch; see
services/engine/scheduler/kv_events.py). The hub receives each Session response that
carries any (`on_session_response`, called by the EngineClients on the event loop),
turns its events into one KvEventBatch for that engine's dp_rank and numbers the
batches with one counter for the whole frontend, from 1, without gaps. It keeps the
last `history` batches so that a subscriber can resume (`start_sequence_number`).

Translation (what the README's table says):
- BlockStored -> KvBlocksStored. Consecutive stores of one chain (each block's parent
  the block before it) share one event, as vLLM groups a request's blocks; the chain's
  first parent is `parent_block_hash`. Each KvBlock carries its token ids and the
  engine's block size; tier DEVICE (the engine's own KV cache, on whatever device).
- BlockRemoved -> KvBlocksRemoved, consecutive ones grouped.
- CacheCleared -> KvCacheCleared.
- Hashes: our blocks are named by 32-byte sha256 digests, the proto by int64: the
  first 8 bytes of the digest read big-endian as a signed integer (`block_hash_int64`).
  The same block always maps to the same number; 64 bits of sha256 collide with
  probability ~n^2 / 2^65.
- event_id: the engine's own seq of the first event in the group.
- load: the engine's scheduler stats from the same Session response (running,
  waiting, KV usage), `sample` the batch's sequence number.
- A Session that (re)opens with a snapshot that does not continue what the hub saw
  last from that engine (a restarted engine: new epoch; or events missed while the
  Session was down) yields a KvCacheCleared batch for its rank: subscribers forget
  what they knew of it, which can only make them underestimate its cache. Blocks a
  snapshot lists are never described (it has no token ids): a subscriber learns an
  engine's blocks from the events after it joined.

A subscriber that falls `queue_size` batches behind is ended (RESOURCE_EXHAUSTED)
rather than sent a stream with a hole; it resumes with start_sequence_number.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import time
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass

import grpc
from corestream.engine.v1 import engine_core_service_pb2 as engine_pb2
from corestream.vendor.smg_grpc_proto import common_pb2 as smg_common_pb2

from services.common.kv_runs import RemovedRun, Run, RunBuilder, StoredRun
from services.frontend.errors import RequestError
from services.frontend.routing.engine_client import EngineClient

log = logging.getLogger(__name__)

HISTORY_BATCHES = 4096
SUBSCRIBER_QUEUE_BATCHES = 4096


def block_hash_int64(block_hash: bytes) -> int:
    """The proto's int64 for one of our 32-byte block hashes: its first 8 bytes,
    big-endian, two's complement."""
    return int.from_bytes(block_hash[:8], "big", signed=True)


def to_vllm_events(events: Sequence[engine_pb2.KvCacheEvent], block_size: int
                   ) -> list[smg_common_pb2.KvCacheEvent]:
    """One engine response's events as vLLM's, chains and removals grouped (each group
    keeps the seq of its first event as its event_id)."""
    runs = RunBuilder()
    for event in events:
        kind = event.WhichOneof("kind")
        if kind == "stored":
            runs.stored(event.seq, event.stored.block_hash, event.stored.parent_hash,
                        event.stored.token_ids)
        elif kind == "removed":
            runs.removed(event.seq, event.removed.block_hash)
        else:
            runs.cleared(event.seq)
    return [_to_proto(run, block_size) for run in runs.runs]


def _to_proto(run: Run, block_size: int) -> smg_common_pb2.KvCacheEvent:
    if isinstance(run, StoredRun):
        group = smg_common_pb2.KvBlocksStored(
            blocks=[smg_common_pb2.KvBlock(block_hash=block_hash_int64(h), block_size=block_size,
                                           token_ids=run.token_ids[i * block_size:
                                                                   (i + 1) * block_size])
                    for i, h in enumerate(run.hashes)],
            tier=smg_common_pb2.KV_CACHE_TIER_DEVICE)
        if run.parent is not None:
            group.parent_block_hash = block_hash_int64(run.parent)
        return smg_common_pb2.KvCacheEvent(event_id=run.first_seq, stored=group)
    if isinstance(run, RemovedRun):
        return smg_common_pb2.KvCacheEvent(
            event_id=run.first_seq, removed=smg_common_pb2.KvBlocksRemoved(
                block_hashes=[block_hash_int64(h) for h in run.hashes],
                tier=smg_common_pb2.KV_CACHE_TIER_DEVICE))
    return smg_common_pb2.KvCacheEvent(event_id=run.seq, cleared=smg_common_pb2.KvCacheCleared())


@dataclass
class _EngineCursor:
    epoch: str
    seq: int
    block_size: int


class _Subscriber:
    def __init__(self, max_batches: int) -> None:
        self.batches: collections.deque[smg_common_pb2.KvEventBatch] = collections.deque()
        self.ready = asyncio.Event()
        self.max_batches = max_batches
        self.overflowed = False

    def put(self, batch: smg_common_pb2.KvEventBatch) -> None:
        if len(self.batches) >= self.max_batches:
            self.overflowed = True
        else:
            self.batches.append(batch)
        self.ready.set()


class KvEventHub:
    def __init__(self, history: int = HISTORY_BATCHES,
                 queue_size: int = SUBSCRIBER_QUEUE_BATCHES,
                 clock: Callable[[], float] = time.time) -> None:
        self._history: collections.deque[smg_common_pb2.KvEventBatch] = collections.deque(
            maxlen=history)
        self._queue_size = queue_size
        self._clock = clock
        self._next_seq = 1
        self._engines: dict[str, _EngineCursor] = {}
        self._subscribers: set[_Subscriber] = set()

    @property
    def num_subscribers(self) -> int:
        return len(self._subscribers)

    @property
    def last_sequence_number(self) -> int:
        """The latest batch's number (0 before the first)."""
        return self._next_seq - 1

    def block_sizes(self) -> set[int]:
        """The block sizes of the engines heard from."""
        return {c.block_size for c in self._engines.values() if c.block_size}

    # ---- from the engines' Sessions -------------------------------------------------

    def on_session_response(self, client: EngineClient,
                            response: engine_pb2.SessionResponse) -> None:
        """An engine's Session response that carries a cache snapshot or events."""
        try:
            self._on_response(client, response)
        except Exception:
            # Called from the Session's reader: a bug here must not end the Session.
            log.exception("KV events of %s: translation failed", client.name)

    def _on_response(self, client: EngineClient,
                     response: engine_pb2.SessionResponse) -> None:
        address = client.address
        events: list[smg_common_pb2.KvCacheEvent] = []
        if response.HasField("kv_cache_snapshot"):
            events += self._snapshot(address, response.kv_cache_snapshot)
        cursor = self._engines.get(address)
        if cursor is None:  # events before any snapshot: nothing to place them against
            return
        if response.kv_cache_events:
            first = response.kv_cache_events[0].seq
            if first != cursor.seq + 1 and not events:
                # A hole in an ordered stream (a bug upstream): start the rank afresh.
                events.append(smg_common_pb2.KvCacheEvent(cleared=smg_common_pb2.KvCacheCleared()))
            events += to_vllm_events(response.kv_cache_events, cursor.block_size)
            cursor.seq = response.kv_cache_events[-1].seq
        if not events:
            return
        batch = smg_common_pb2.KvEventBatch(
            sequence_number=self._next_seq, timestamp=response.timestamp or self._clock(),
            events=events)
        if client.engine_index is not None:
            batch.dp_rank = client.engine_index
        if response.HasField("scheduler_stats"):
            stats = response.scheduler_stats
            batch.load.CopyFrom(smg_common_pb2.EngineLoad(
                running_requests=stats.num_running, waiting_requests=stats.num_waiting,
                token_usage=stats.kv_cache_usage, sample=self._next_seq))
        self._next_seq += 1
        self._history.append(batch)
        for subscriber in self._subscribers:
            subscriber.put(batch)

    def _snapshot(self, address: str, snapshot: engine_pb2.KvCacheSnapshot
                  ) -> list[smg_common_pb2.KvCacheEvent]:
        known = self._engines.get(address)
        self._engines[address] = _EngineCursor(snapshot.epoch, snapshot.seq, snapshot.block_size)
        if known is None or (known.epoch == snapshot.epoch and known.seq == snapshot.seq):
            return []  # new to subscribers, or nothing missed
        return [smg_common_pb2.KvCacheEvent(cleared=smg_common_pb2.KvCacheCleared())]

    # ---- to the subscribers -----------------------------------------------------------

    async def subscribe(self, start_sequence_number: int = 0
                        ) -> AsyncIterator[smg_common_pb2.KvEventBatch]:
        """The batches from `start_sequence_number` on (0: from the next one), as far
        as the history still holds them, then live; RequestError RESOURCE_EXHAUSTED
        when the subscriber falls too far behind."""
        subscriber = _Subscriber(self._queue_size)
        # Backlog and registration without an await between: no batch twice or lost.
        backlog = ([b for b in self._history if b.sequence_number >= start_sequence_number]
                   if start_sequence_number else [])
        self._subscribers.add(subscriber)
        try:
            for batch in backlog:
                yield batch
            while True:
                await subscriber.ready.wait()
                subscriber.ready.clear()
                while subscriber.batches:
                    yield subscriber.batches.popleft()
                if subscriber.overflowed:
                    # What was queued went out, without a hole; the rest it resumes.
                    raise RequestError(
                        grpc.StatusCode.RESOURCE_EXHAUSTED,
                        f"the subscriber fell more than {self._queue_size} batches behind; "
                        "resubscribe with start_sequence_number = the last batch's + 1",
                        reason="KV_EVENTS_OVERFLOW")
        finally:
            self._subscribers.discard(subscriber)
