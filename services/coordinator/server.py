"""CoordinatorService: protobuf edge of the engine registry."""

from __future__ import annotations

import logging
import queue
import time
from collections.abc import Iterator

import grpc
from corestream.coordinator.v1 import coordinator_service_pb2 as pb
from corestream.coordinator.v1 import coordinator_service_pb2_grpc as pb_grpc

from services.coordinator.config import CoordinatorConfig
from services.coordinator.registry import EngineRegistry, Snapshot
from services.coordinator.waves import WaveHub, WaveStart

log = logging.getLogger(__name__)

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["CoordinatorService"].full_name


def snapshot_to_engines(snapshot: Snapshot) -> list[pb.EngineLoad]:
    return [
        pb.EngineLoad(
            engine_id=e.engine_id,
            engine_index=e.engine_index,
            address=e.address,
            model=e.model,
            num_waiting=e.num_waiting,
            num_running=e.num_running,
            kv_cache_usage=e.kv_cache_usage,
            state=e.state,
            step_counter=e.step_counter,
            wave=e.wave,
            wave_running=e.wave_running,
            max_num_seqs=e.max_num_seqs,
            tensor_parallel_size=e.tensor_parallel_size,
            sleep_level=e.sleep_level,
        )
        for e in snapshot.engines
    ]


class CoordinatorServicer(pb_grpc.CoordinatorServiceServicer):
    def __init__(self, config: CoordinatorConfig, registry: EngineRegistry,
                 waves: WaveHub | None = None) -> None:
        self._config = config
        self._registry = registry
        self.waves = waves or WaveHub()

    def RegisterEngine(
        self, request: pb.RegisterEngineRequest, context: grpc.ServicerContext
    ) -> pb.RegisterEngineResponse:
        if not request.address:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, "address must not be empty")
        engine_id = self._registry.register(
            request.engine_index,
            request.address,
            request.model,
            request.max_model_len,
            state=request.state,
            max_num_seqs=request.max_num_seqs,
            tensor_parallel_size=request.tensor_parallel_size,
        )
        log.info(
            "registered %s (index %d) at %s serving %r",
            engine_id, request.engine_index, request.address, request.model,
        )
        return pb.RegisterEngineResponse(
            engine_id=engine_id,
            report_interval_s=self._config.report_interval_s,
            lease_timeout_s=self._config.lease_timeout_s,
        )

    def ReportLoad(
        self, request_iterator: Iterator[pb.ReportLoadRequest], context: grpc.ServicerContext
    ) -> pb.ReportLoadResponse:
        engine_id = ""
        try:
            for report in request_iterator:
                engine_id = report.engine_id
                known = self._registry.update(
                    engine_id,
                    num_waiting=report.num_waiting,
                    num_running=report.num_running,
                    kv_cache_usage=report.kv_cache_usage,
                    state=report.state,
                    step_counter=report.step_counter,
                    wave=report.wave,
                    wave_running=report.wave_running,
                    sleep_level=report.sleep_level,
                )
                if not known:
                    context.abort(
                        grpc.StatusCode.NOT_FOUND,
                        f"engine_id {engine_id!r} is not registered (never, or its "
                        f"{self._config.lease_timeout_s:g} s lease expired); "
                        "call RegisterEngine again",
                    )
        except grpc.RpcError:
            pass  # the engine went away mid-stream; handled below
        finally:
            # The report stream is the engine's lease: when it ends, so does the entry.
            if engine_id:
                self._registry.remove(engine_id)
                log.info("%s left", engine_id)
        return pb.ReportLoadResponse()

    def WatchLoad(
        self, request: pb.WatchLoadRequest, context: grpc.ServicerContext
    ) -> Iterator[pb.WatchLoadResponse]:
        snapshot = self._registry.snapshot()
        while context.is_active() and not self._registry.closed:
            yield pb.WatchLoadResponse(
                engines=snapshot_to_engines(snapshot), generation=snapshot.generation
            )
            sent_at = time.monotonic()
            # Rate-limit bursts of changes, then wait for the next change or heartbeat.
            time.sleep(self._config.watch_min_interval_s)
            remaining = self._config.watch_heartbeat_s - (time.monotonic() - sent_at)
            snapshot = self._registry.wait_for_change(snapshot.generation, max(remaining, 0.0))

    def expire_leases(self) -> None:
        """Drop the engines that have not reported within the lease."""
        for entry in self._registry.expire(self._config.lease_timeout_s):
            log.warning(
                "%s (index %d) at %s sent no report for %g s; dropped",
                entry.engine_id, entry.engine_index, entry.address, self._config.lease_timeout_s,
            )

    def ListEngines(
        self, request: pb.ListEnginesRequest, context: grpc.ServicerContext
    ) -> pb.ListEnginesResponse:
        snapshot = self._registry.snapshot()
        return pb.ListEnginesResponse(
            engines=snapshot_to_engines(snapshot), generation=snapshot.generation
        )

    def StartWave(  # noqa: N802 (gRPC method name)
        self, request: pb.StartWaveRequest, context: grpc.ServicerContext
    ) -> pb.StartWaveResponse:
        n = self.waves.announce(request.model, WaveStart(request.wave, request.engine_index))
        log.debug("engine %d started wave %d of %r; relayed to %d", request.engine_index,
                  request.wave, request.model, n)
        return pb.StartWaveResponse(num_relayed=n)

    def WatchWaves(  # noqa: N802 (gRPC method name)
        self, request: pb.WatchWavesRequest, context: grpc.ServicerContext
    ) -> Iterator[pb.WatchWavesResponse]:
        q = self.waves.subscribe(request.model, request.engine_index)
        try:
            while context.is_active():
                try:
                    start = q.get(timeout=1.0)  # wake now and then to notice a gone client
                except queue.Empty:
                    continue
                if start is None:
                    return
                yield pb.WatchWavesResponse(wave=start.wave, started_by=start.started_by)
        finally:
            self.waves.unsubscribe(request.model, request.engine_index, q)
