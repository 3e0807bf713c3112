from __future__ import annotations

import queue
import threading
import time
from collections.abc import Iterator
from concurrent import futures

import grpc
import pytest
from corestream.common.v1 import common_pb2
from corestream.coordinator.v1 import coordinator_service_pb2 as pb
from corestream.coordinator.v1 import coordinator_service_pb2_grpc as pb_grpc

from services.coordinator.config import CoordinatorConfig
from services.coordinator.registry import EngineRegistry
from services.coordinator.server import CoordinatorServicer

RUNNING = common_pb2.ENGINE_STATE_RUNNING


@pytest.fixture
def stub() -> Iterator[pb_grpc.CoordinatorServiceStub]:
    registry = EngineRegistry()
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=8))
    config = CoordinatorConfig(watch_min_interval_s=0.01, watch_heartbeat_s=0.5)
    pb_grpc.add_CoordinatorServiceServicer_to_server(CoordinatorServicer(config, registry), server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        yield pb_grpc.CoordinatorServiceStub(channel)
    registry.close()
    server.stop(0)


def next_matching(watch: Iterator[pb.WatchLoadResponse], pred) -> pb.WatchLoadResponse:  # type: ignore[no-untyped-def]
    for snapshot in watch:
        if pred(snapshot):
            return snapshot
    raise AssertionError("watch ended")


@pytest.mark.timeout(30)
def test_register_report_watch_and_lease(stub: pb_grpc.CoordinatorServiceStub) -> None:
    watch = stub.WatchLoad(pb.WatchLoadRequest(), timeout=20)
    assert next(watch).engines == []

    reply = stub.RegisterEngine(pb.RegisterEngineRequest(
        engine_index=3, address="127.0.0.1:9999", model="tiny", max_model_len=128,
        max_num_seqs=16, tensor_parallel_size=2))
    assert reply.engine_id and reply.report_interval_s > 0
    assert reply.lease_timeout_s >= 2 * reply.report_interval_s

    reports: queue.Queue[pb.ReportLoadRequest | None] = queue.Queue()

    def requests() -> Iterator[pb.ReportLoadRequest]:
        while (item := reports.get()) is not None:
            yield item

    done = threading.Event()
    threading.Thread(target=lambda: (stub.ReportLoad(requests()), done.set()), daemon=True).start()
    reports.put(pb.ReportLoadRequest(engine_id=reply.engine_id, num_waiting=2, num_running=5,
                                     kv_cache_usage=0.25, state=RUNNING, step_counter=1))
    snap = next_matching(watch, lambda s: s.engines and s.engines[0].num_running == 5)
    engine = snap.engines[0]
    assert (engine.engine_index, engine.address, engine.num_waiting) == (3, "127.0.0.1:9999", 2)
    assert engine.state == RUNNING and engine.max_num_seqs == 16
    assert engine.tensor_parallel_size == 2
    [listed] = stub.ListEngines(pb.ListEnginesRequest()).engines
    assert listed.tensor_parallel_size == 2

    # The report stream is the lease: closing it removes the engine.
    reports.put(None)
    assert done.wait(10)
    next_matching(watch, lambda s: not s.engines)
    watch.cancel()


@pytest.mark.timeout(30)
def test_report_for_unknown_engine_is_rejected(stub: pb_grpc.CoordinatorServiceStub) -> None:
    with pytest.raises(grpc.RpcError) as err:
        stub.ReportLoad(iter([pb.ReportLoadRequest(engine_id="nope")]))
    assert err.value.code() == grpc.StatusCode.NOT_FOUND
    assert "RegisterEngine" in err.value.details()


def test_register_requires_address(stub: pb_grpc.CoordinatorServiceStub) -> None:
    with pytest.raises(grpc.RpcError) as err:
        stub.RegisterEngine(pb.RegisterEngineRequest(engine_index=0))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT


@pytest.mark.timeout(30)
def test_lease_expiry_drops_a_silent_engine_and_rejects_its_reports() -> None:
    registry = EngineRegistry()
    config = CoordinatorConfig(report_interval_s=0.05, lease_timeout_s=0.2)
    servicer = CoordinatorServicer(config, registry)
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    pb_grpc.add_CoordinatorServiceServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            stub = pb_grpc.CoordinatorServiceStub(channel)
            reply = stub.RegisterEngine(pb.RegisterEngineRequest(
                engine_index=0, address="a:1", state=RUNNING))
            # Registered in its state: routable before its first report.
            assert registry.snapshot().engines[0].state == RUNNING
            reports: queue.Queue[pb.ReportLoadRequest | None] = queue.Queue()
            outcome: list[grpc.RpcError] = []

            def report() -> None:
                try:
                    stub.ReportLoad(iter(reports.get, None))
                except grpc.RpcError as e:
                    outcome.append(e)

            thread = threading.Thread(target=report, daemon=True)
            thread.start()
            reports.put(pb.ReportLoadRequest(engine_id=reply.engine_id, state=RUNNING))
            time.sleep(0.3)  # silent (a frozen engine keeps its stream open) past the lease
            servicer.expire_leases()
            assert registry.snapshot().engines == ()
            reports.put(pb.ReportLoadRequest(engine_id=reply.engine_id, state=RUNNING))
            thread.join(10)
            assert outcome and outcome[0].code() == grpc.StatusCode.NOT_FOUND
            assert "lease expired" in outcome[0].details()
    finally:
        registry.close()
        server.stop(0)


def test_lease_must_outlast_two_reports() -> None:
    with pytest.raises(ValueError, match="lease_timeout_s must be >= 2"):
        CoordinatorConfig(report_interval_s=1.0, lease_timeout_s=1.5)
