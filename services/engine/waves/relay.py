"""WaveRelay: an expert-parallel engine's line to the coordinator's WaveHub.

`announce(wave)` returns at once: a sender thread delivers it with retries, since
the announcing rank is by then blocked in its first collective, waiting for the
others to join; if the coordinator is away, the start reaches them when it
returns (within the group's collective timeout, or the ranks fail their requests
with UNAVAILABLE). A watcher thread keeps a WatchWaves stream open, reconnecting
with backoff, and hands every relayed start to the engine.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable

import grpc
from corestream.coordinator.v1 import coordinator_service_pb2 as pb
from corestream.coordinator.v1 import coordinator_service_pb2_grpc

from services.common.backoff import Backoff
from services.common.grpc_server import make_channel
from services.common.security_config import PLAINTEXT, SecurityConfig
from services.common.thread_names import name_native_thread

logger = logging.getLogger(__name__)

ANNOUNCE_TIMEOUT_S = 5.0


class WaveRelay:
    def __init__(self, coordinator: str, group: str, engine_index: int,
                 on_start: Callable[[int], None], security: SecurityConfig = PLAINTEXT) -> None:
        self._group = group
        self._engine_index = engine_index
        self._on_start = on_start
        self._channel = make_channel(coordinator, security)
        self._stub = coordinator_service_pb2_grpc.CoordinatorServiceStub(self._channel)
        self._outbox: queue.Queue[int | None] = queue.Queue()
        self._stop = threading.Event()
        self.subscribed = threading.Event()
        self._watch: grpc.Future | None = None
        self._threads = [
            threading.Thread(target=self._send, name="wave-announce", daemon=True),
            threading.Thread(target=self._listen, name="wave-watch", daemon=True),
        ]

    def start(self) -> None:
        for t in self._threads:
            t.start()

    def announce(self, wave: int) -> None:
        self._outbox.put(wave)

    def stop(self) -> None:
        self._stop.set()
        self._outbox.put(None)
        if self._watch is not None:
            self._watch.cancel()
        for t in self._threads:
            t.join(2.0)
        self._channel.close()

    def _send(self) -> None:
        name_native_thread()
        backoff = Backoff(initial_s=0.05, max_s=1.0)
        while (wave := self._outbox.get()) is not None:
            request = pb.StartWaveRequest(model=self._group, engine_index=self._engine_index,
                                          wave=wave)
            while not self._stop.is_set():
                try:
                    self._stub.StartWave(request, timeout=ANNOUNCE_TIMEOUT_S)
                    backoff.reset()
                    break
                except grpc.RpcError as exc:
                    logger.warning("could not announce wave %d to the coordinator (%s); "
                                   "retrying", wave, exc.code().name)
                    self._stop.wait(backoff.next_delay())
                except ValueError:
                    return  # the channel was closed by stop()

    def _listen(self) -> None:
        name_native_thread()
        backoff = Backoff(initial_s=0.1, max_s=2.0)
        request = pb.WatchWavesRequest(model=self._group, engine_index=self._engine_index)
        while not self._stop.is_set():
            try:
                self._watch = stream = self._stub.WatchWaves(request)
                self.subscribed.set()  # the hub queues starts from the call's arrival on
                for start in stream:
                    backoff.reset()
                    self._on_start(start.wave)
            except grpc.RpcError as exc:
                if self._stop.is_set():
                    return
                logger.warning("wave stream from the coordinator broke (%s); reconnecting",
                               exc.code().name)
            except ValueError:
                return
            self.subscribed.clear()
            self._stop.wait(backoff.next_delay())
