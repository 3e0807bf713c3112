"""LoadReporter: registers this engine with the DP coordinator and streams its load.

The coordinator may start after the engine, so registration retries until it is
answered. Then one ReportLoad client stream stays open: a report goes out when
the load changes (checked every 100 ms) and at least every `report_interval_s`
the coordinator asked for. If the stream breaks (coordinator restarted), the
engine registers again. Closing the stream on stop removes the engine from the
registry.
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

from services.common.grpc_server import channel_options
from services.engine.scheduler.scheduler import SchedulerStats
from services.engine.session_router import EngineState

logger = logging.getLogger(__name__)

POLL_S = 0.1
RETRY_S = (0.2, 0.5, 1.0, 2.0)


class LoadReporter:
    def __init__(
        self,
        coordinator: str,
        registration: pb.RegisterEngineRequest,
        load: Callable[[], tuple[SchedulerStats, EngineState]],
    ) -> None:
        self._registration = registration
        self._load = load
        self._stop = threading.Event()
        self._channel = grpc.insecure_channel(coordinator, options=channel_options())
        self._stub = coordinator_service_pb2_grpc.CoordinatorServiceStub(self._channel)
        self._thread = threading.Thread(target=self._run, name="load-reporter", daemon=True)
        self._call: grpc.Future | None = None

    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout_s: float = 5.0) -> None:
        self._stop.set()
        self._thread.join(timeout_s)
        self._channel.close()

    def _run(self) -> None:
        failures = 0
        while not self._stop.is_set():
            try:
                reply = self._stub.RegisterEngine(self._registration, timeout=5)
                logger.info("registered with the coordinator as %s", reply.engine_id)
                failures = 0
                interval = reply.report_interval_s or 1.0
                self._stub.ReportLoad(self._reports(reply.engine_id, interval))
            except grpc.RpcError as exc:
                if self._stop.is_set():
                    return
                delay = RETRY_S[min(failures, len(RETRY_S) - 1)]
                failures += 1
                logger.log(logging.INFO if failures == 1 else logging.DEBUG,
                           "coordinator unreachable (%s); retrying in %.1fs", exc.code(), delay)
                self._stop.wait(delay)
            except ValueError:
                return  # the channel was closed by stop()

    def _reports(self, engine_id: str, interval_s: float) -> Iterator[pb.ReportLoadRequest]:
        last: tuple[object, ...] | None = None
        last_sent = 0.0
        while not self._stop.is_set():
            stats, state = self._load()
            key = (stats.num_waiting, stats.num_running, round(stats.kv_cache_usage, 3), state)
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
                )
            self._stop.wait(POLL_S)
