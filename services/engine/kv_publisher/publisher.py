"""KvEventPublisher: a thread that puts the engine's prefix-cache events on a ZeroMQ
PUB socket in vLLM's wire format (wire.py) and answers replay requests.

The busy loop only hands over each step's events (a queue put); translating,
packing and sending happen on this thread, so a slow or absent subscriber costs
the loop nothing: PUB drops what a subscriber cannot take (its high-water mark),
and the subscriber finds the gap in the sequence numbers and asks the replay
socket for what it missed, from the last `buffer_steps` batches.

A replay request is one frame, the first wanted sequence number (8 bytes, big
endian), from a REQ socket or a DEALER that sends an empty delimiter frame first.
The answer is one (sequence number, payload) message per buffered batch from there
on, then END_SEQ with an empty payload, each behind the requester's envelope.
"""

from __future__ import annotations

import collections
import logging
import queue
import threading
import time

import zmq

from services.engine.kv_publisher.config import KvEventsConfig, binds, endpoint_for_rank
from services.engine.kv_publisher.wire import END_SEQ, encode_batch, seq_frame
from services.engine.scheduler.kv_events import KvEvent

logger = logging.getLogger(__name__)

SEND_HWM = 100_000
LINGER_MS = 500
REPLAY_POLL_S = 0.05
"""How long the thread waits for events before it looks at the replay socket again."""

_STOP = object()


class KvEventPublisher:
    def __init__(self, config: KvEventsConfig, rank: int, block_size: int) -> None:
        offset = rank if config.kv_events_offset_ports else 0
        self.endpoint = endpoint_for_rank(config.kv_events_endpoint, offset)
        self.replay_endpoint = endpoint_for_rank(config.kv_events_replay_endpoint, offset)
        self._format = config.kv_events_format
        self._rank = rank
        self._block_size = block_size
        self._topic = config.kv_events_topic.encode()
        self._buffer: collections.deque[tuple[int, bytes]] = collections.deque(
            maxlen=config.kv_events_buffer_steps)
        self._queue: queue.SimpleQueue[object] = queue.SimpleQueue()
        self._next_seq = 0
        # Bound here, on the caller's thread, so that a port in use fails the start
        # with its reason; only the publisher thread touches the sockets afterwards.
        self._context = zmq.Context.instance()
        self._pub = self._context.socket(zmq.PUB)
        self._pub.setsockopt(zmq.SNDHWM, SEND_HWM)
        self._pub.setsockopt(zmq.LINGER, LINGER_MS)
        self._replay: zmq.Socket[bytes] | None = None
        try:
            if binds(self.endpoint):
                self._pub.bind(self.endpoint)
            else:
                self._pub.connect(self.endpoint)
            if self.replay_endpoint:
                self._replay = self._context.socket(zmq.ROUTER)
                self._replay.setsockopt(zmq.LINGER, 0)
                self._replay.bind(self.replay_endpoint)
        except zmq.ZMQError as e:
            self._close_sockets()
            raise ValueError(f"kv events: cannot open {self.endpoint} "
                             f"(replay {self.replay_endpoint or 'off'}): {e}") from e
        self._thread = threading.Thread(target=self._run, name="kv-event-publisher",
                                        daemon=True)
        self._thread.start()
        logger.info("publishing KV events (%s layout) on %s%s, topic %r", self._format,
                    self.endpoint, f", replay on {self.replay_endpoint}"
                    if self.replay_endpoint else "", self._topic.decode())

    def publish(self, events: tuple[KvEvent, ...]) -> None:
        """One step's events (the busy loop's thread): stamped now, sent soon."""
        if events:
            self._queue.put((time.time(), events))

    def close(self, timeout_s: float = 2.0) -> None:
        """Send what is queued, then close the sockets."""
        self._queue.put(_STOP)
        self._thread.join(timeout_s)

    def _run(self) -> None:
        try:
            while True:
                try:
                    item = self._queue.get(timeout=REPLAY_POLL_S if self._replay else None)
                except queue.Empty:
                    item = None
                if item is _STOP:
                    return
                if item is not None:
                    self._send(*item)  # type: ignore[misc]
                while self._replay is not None and self._replay.poll(0):
                    self._answer_replay()
        except Exception:
            logger.exception("the KV event publisher stopped")
        finally:
            self._close_sockets()

    def _send(self, timestamp: float, events: tuple[KvEvent, ...]) -> None:
        payload = encode_batch(self._format, timestamp, events, self._block_size, self._rank)
        seq = self._next_seq
        self._next_seq += 1
        self._buffer.append((seq, payload))
        self._pub.send_multipart((self._topic, seq_frame(seq), payload))

    def _answer_replay(self) -> None:
        assert self._replay is not None
        frames = self._replay.recv_multipart()
        # [identity, "", start] from a REQ (or a DEALER that adds the delimiter),
        # [identity, start] from a bare DEALER.
        envelope, start = frames[:-1], frames[-1]
        if len(envelope) not in (1, 2) or len(start) != 8:
            logger.warning("kv events: ignored a malformed replay request (%d frames)",
                           len(frames))
            return
        first = int.from_bytes(start, "big")
        for seq, payload in self._buffer:
            if seq >= first:
                self._replay.send_multipart((*envelope, seq_frame(seq), payload))
        self._replay.send_multipart((*envelope, END_SEQ, b""))

    def _close_sockets(self) -> None:
        self._pub.close()
        if self._replay is not None:
            self._replay.close()
