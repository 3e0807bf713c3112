"""LoadReporter: registers this engine with the DP coordinator and streams its load.

The coordinator may start after the engine, go away and come back: the engine
serves its Sessions regardless (a frontend keeps routing to the engines it
knows), while this thread registers again with backoff until it is answered.
Then one ReportLoad client stream stays open: a report goes out when the load
changes (checked every 100 ms) and at least every `report_interval_s` the
coordinator asked for, which renews the engine's lease there. A stream ended
with NOT_FOUND (the lease expired, say after the process was frozen) registers
again at once. Closing the stream on stop removes the engine from the registry.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterator

import grpc
from corestream.common.v1 import common_pb2
from corestream.coordinator.v1 import coordinator_service_pb2 as pb
from corestream.coordinator.v1 import coordinator_service_pb2_grpc

from services.common.backoff import Backoff
from services.common.grpc_server import make_channel
from services.common.security_config import PLAINTEXT, SecurityConfig
from services.common.thread_names import name_native_thread
from services.engine.messages import EngineState
from services.engine.scheduler.scheduler import SchedulerStats
from services.engine.waves.state import WaveState

logger = logging.getLogger(__name__)

POLL_S = 0.1
REGISTER_TIMEOUT_S = 5.0


class LoadReporter:
    def __init__(
        self,
        coordinator: str,
        registration: pb.RegisterEngineRequest,
        load: Callable[[], tuple[SchedulerStats, EngineState]],
        security: SecurityConfig = PLAINTEXT,
        wave: Callable[[], WaveState | None] = lambda: None,
        sleep_level: Callable[[], int] = lambda: 0,
    ) -> None:
        self._coordinator = coordinator
        self._registration = registration
        self._load = load
        self._wave = wave
        self._sleep_level = sleep_level
        self._stop = threading.Event()
        self._channel = make_channel(coordinator, security)
        self._stub = coordinator_service_pb2_grpc.CoordinatorServiceStub(self._channel)
        self._thread = threading.Thread(target=self._run, name="load-reporter", daemon=True)
        self._registered = False

    @property
    def registered(self) -> bool:
        """Registered and reporting; False while the coordinator is out of reach."""
        return self._registered

    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout_s: float = 5.0) -> None:
        self._stop.set()
        self._thread.join(timeout_s)
        self._channel.close()

    def _run(self) -> None:
        name_native_thread()
        backoff = Backoff(initial_s=0.2, max_s=2.0)
        ever_registered = False
        failures = 0
        while not self._stop.is_set():
            try:
                registration = pb.RegisterEngineRequest()
                registration.CopyFrom(self._registration)
                registration.state = common_pb2.EngineState.ValueType(int(self._load()[1]))
                reply = self._stub.RegisterEngine(registration, timeout=REGISTER_TIMEOUT_S)
                self._registered = True
                backoff.reset()
                failures = 0
                logger.info("%s with the coordinator at %s as %s",
                            "registered again" if ever_registered else "registered",
                            self._coordinator, reply.engine_id)
                ever_registered = True
                interval = reply.report_interval_s or 1.0
                self._stub.ReportLoad(self._reports(reply.engine_id, interval))
                reason = "the report stream ended"
            except grpc.RpcError as exc:
                if self._stop.is_set():
                    return
                if exc.code() == grpc.StatusCode.NOT_FOUND:
                    logger.warning("the coordinator forgot this engine (%s); registering again",
                                   exc.details())
                    continue
                reason = f"{exc.code().name}: {exc.details()}"
            except ValueError:
                return  # the channel was closed by stop()
            if self._stop.is_set():
                return
            delay = backoff.next_delay()
            # Loud once per loss, quiet while it lasts.
            if self._registered:
                level = logging.WARNING
            elif failures == 0:
                level = logging.INFO
            else:
                level = logging.DEBUG
            logger.log(level, "coordinator %s unreachable (%s); still serving, retrying in %.1f s",
                       self._coordinator, reason, delay)
            self._registered = False
            failures += 1
            self._stop.wait(delay)

    def _reports(self, engine_id: str, interval_s: float) -> Iterator[pb.ReportLoadRequest]:
        last: tuple[object, ...] | None = None
        last_sent = 0.0
        while not self._stop.is_set():
            stats, state = self._load()
            wave = self._wave()
            wave_key = (wave.wave, wave.running) if wave is not None else (0, False)
            sleep_level = self._sleep_level()
            key = (stats.num_waiting, stats.num_running, round(stats.kv_cache_usage, 3), state,
                   wave_key, sleep_level)
            now = time.monotonic()
            if key != last or now - last_sent >= interval_s:
                last, last_sent = key, now
                yield pb.ReportLoadRequest(
                    engine_id=engine_id,
                    num_waiting=stats.num_waiting,
                    num_running=stats.num_running,
                    kv_cache_usage=stats.kv_cache_usage,
                    state=common_pb2.EngineState.ValueType(int(state)),
                    step_counter=stats.step_counter,
                    wave=wave_key[0],
                    wave_running=wave_key[1],
                    sleep_level=sleep_level,
                )
            self._stop.wait(POLL_S)
