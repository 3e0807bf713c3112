"""The publisher's sockets: live batches numbered without gaps, replay of what a
subscriber missed (PUB drops whatever is sent before a subscriber is connected),
the topic frame, and a clear error for an endpoint it cannot open."""

from __future__ import annotations

from collections.abc import Iterator

import msgpack
import pytest
import zmq

from services.common.block_hash import NO_PARENT, hash_block
from services.common.ports import free_port, port_in_use
from services.engine.kv_publisher.config import KvEventsConfig
from services.engine.kv_publisher.publisher import KvEventPublisher
from services.engine.kv_publisher.wire import END_SEQ
from services.engine.scheduler.kv_events import BlockRemoved, BlockStored

pytestmark = pytest.mark.timeout(60)
TIMEOUT_MS = 10_000


def _stored(seq: int) -> tuple[BlockStored, ...]:
    return (BlockStored(seq, hash_block(None, [seq, seq]), NO_PARENT, (seq, seq)),)


@pytest.fixture
def sockets() -> Iterator[tuple[zmq.Socket, zmq.Socket, KvEventPublisher]]:
    # As llm-d deploys it: the subscriber binds, the engine dials it.
    context = zmq.Context.instance()
    sub = context.socket(zmq.SUB)
    port = sub.bind_to_random_port("tcp://127.0.0.1")
    sub.setsockopt(zmq.SUBSCRIBE, b"kv@")
    sub.setsockopt(zmq.RCVTIMEO, TIMEOUT_MS)
    replay_port = free_port()
    publisher = KvEventPublisher(KvEventsConfig(
        kv_events_endpoint=f"tcp://127.0.0.1:{port}",
        kv_events_replay_endpoint=f"tcp://127.0.0.1:{replay_port}",
        kv_events_topic="kv@10.0.0.7@tiny"), rank=0, block_size=2)
    replay = context.socket(zmq.DEALER)
    replay.setsockopt(zmq.RCVTIMEO, TIMEOUT_MS)
    replay.connect(f"tcp://127.0.0.1:{replay_port}")
    try:
        yield sub, replay, publisher
    finally:
        publisher.close()
        sub.close(0)
        replay.close(0)


def _replay(replay: zmq.Socket, start: int) -> list[tuple[int, bytes]]:
    replay.send_multipart((b"", start.to_bytes(8, "big")))
    got = []
    while True:
        empty, seq, payload = replay.recv_multipart()
        assert empty == b""
        if seq == END_SEQ:
            assert payload == b""
            return got
        got.append((int.from_bytes(seq, "big"), payload))


def test_live_batches_have_consecutive_seqs_and_replay_returns_what_was_missed(
        sockets: tuple[zmq.Socket, zmq.Socket, KvEventPublisher]) -> None:
    sub, replay, publisher = sockets
    # Until the connection is up, batches go nowhere: publish until one arrives.
    first = None
    for seq in range(1, 1000):
        publisher.publish(_stored(seq))
        if sub.poll(20):
            topic, first_seq, _ = sub.recv_multipart()
            assert topic == b"kv@10.0.0.7@tiny"
            first = int.from_bytes(first_seq, "big")
            break
    assert first is not None, "no batch arrived"
    sent = seq
    for seq in range(sent + 1, sent + 21):
        publisher.publish(_stored(seq))
    publisher.publish(())  # a step without events sends nothing
    publisher.publish((BlockRemoved(99, hash_block(None, [1, 1])),))
    live = [sub.recv_multipart() for _ in range(sent - first + 20)]
    seqs = [int.from_bytes(s, "big") for _, s, _ in live]
    assert seqs == list(range(first + 1, sent + 21))  # no gap once connected
    missed = _replay(replay, 0)
    assert [s for s, _ in missed] == list(range(sent + 21))
    ts, events, rank = msgpack.unpackb(missed[0][1])
    assert rank == 0 and ts > 0
    assert events[0]["token_ids"] == [1, 1] and events[0]["block_size"] == 2
    assert msgpack.unpackb(missed[-1][1])[1] == [
        {"type": "BlockRemoved", "block_hashes": [hash_block(None, [1, 1])], "medium": "GPU"}]
    # From the middle, and from past the end (only the end marker).
    assert [s for s, _ in _replay(replay, 5)] == list(range(5, sent + 21))
    assert _replay(replay, 10_000) == []


def test_a_port_in_use_is_a_clear_start_error() -> None:
    context = zmq.Context.instance()
    taken = context.socket(zmq.ROUTER)
    port = taken.bind_to_random_port("tcp://127.0.0.1")
    try:
        with pytest.raises(ValueError, match=f"replay tcp://127.0.0.1:{port}"):
            KvEventPublisher(KvEventsConfig(
                kv_events_endpoint="tcp://127.0.0.1:1",
                kv_events_replay_endpoint=f"tcp://127.0.0.1:{port}"), rank=0, block_size=16)
    finally:
        taken.close(0)


def test_malformed_replay_requests_are_ignored_and_the_socket_keeps_serving(
        sockets: tuple[zmq.Socket, zmq.Socket, KvEventPublisher]) -> None:
    _, replay, publisher = sockets
    publisher.publish(_stored(1))
    for frames in ((b"",), (b"", b"short"), (b"", b"x" * 9), (b"a", b"b", b"c" * 8)):
        replay.send_multipart(frames)
    assert [s for s, _ in _replay(replay, 0)] == [0]  # the only answer is to this one
    assert not replay.poll(200)


@pytest.mark.parametrize("offset", [True, False])
def test_engine_n_moves_its_ports_up_by_n_unless_told_not_to(offset: bool) -> None:
    base = free_port()  # dialled, never bound: it may be anything
    replay = next(p for p in iter(free_port, None) if port_in_use("127.0.0.1", p + 3) is None)
    publisher = KvEventPublisher(KvEventsConfig(
        kv_events_endpoint=f"tcp://127.0.0.1:{base}",
        kv_events_replay_endpoint=f"tcp://127.0.0.1:{replay}",
        kv_events_offset_ports=offset), rank=3, block_size=16)
    try:
        shift = 3 if offset else 0
        assert publisher.endpoint == f"tcp://127.0.0.1:{base + shift}"
        assert publisher.replay_endpoint == f"tcp://127.0.0.1:{replay + shift}"
    finally:
        publisher.close()
