"""CoordinatorService: protobuf edge of the engine registry."""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator

import grpc
from corestream.coordinator.v1 import coordinator_service_pb2 as pb
from corestream.coordinator.v1 import coordinator_service_pb2_grpc as pb_grpc

from services.coordinator.config import CoordinatorConfig
from services.coordinator.registry import EngineRegistry, Snapshot

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
        )
        for e in snapshot.engines
    ]


class CoordinatorServicer(pb_grpc.CoordinatorServiceServicer):
    def __init__(self, config: CoordinatorConfig, registry: EngineRegistry) -> None:
        self._config = config
        self._registry = registry

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
            state=0,
        )
        log.info(
            "registered %s (index %d) at %s serving %r",
            engine_id, request.engine_index, request.address, request.model,
        )
        return pb.RegisterEngineResponse(
            engine_id=engine_id, report_interval_s=self._config.report_interval_s
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
                )
                if not known:
                    context.abort(
                        grpc.StatusCode.NOT_FOUND,
                        f"engine_id {engine_id!r} is not registered; call RegisterEngine first",
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

    def ListEngines(
        self, request: pb.ListEnginesRequest, context: grpc.ServicerContext
    ) -> pb.ListEnginesResponse:
        snapshot = self._registry.snapshot()
        return pb.ListEnginesResponse(
            engines=snapshot_to_engines(snapshot), generation=snapshot.generation
        )
