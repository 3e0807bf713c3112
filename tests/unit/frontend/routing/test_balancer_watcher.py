"""LoadWatcher + Balancer against a real in-process CoordinatorService that goes away
and comes back (the engines' clients are stubs: no engine processes here)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from concurrent import futures

import grpc
import pytest
from corestream.common.v1 import common_pb2
from corestream.coordinator.v1 import coordinator_service_pb2_grpc as pb_grpc

from services.coordinator.config import CoordinatorConfig
from services.coordinator.registry import EngineRegistry
from services.coordinator.server import CoordinatorServicer
from services.frontend.routing import load_watcher
from services.frontend.routing.balancer import Balancer
from services.frontend.routing.load_watcher import LoadWatcher
from tests.integration.cluster import free_port
from tests.unit.frontend.fakes import StubClient

RUNNING = common_pb2.ENGINE_STATE_RUNNING


def start_coordinator(port: int, addresses: list[str]) -> tuple[grpc.Server, EngineRegistry]:
    registry = EngineRegistry()
    for index, address in enumerate(addresses):
        registry.register(index, address, "m", 128, state=RUNNING)
    config = CoordinatorConfig(watch_min_interval_s=0.01, watch_heartbeat_s=0.2)
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=8))
    pb_grpc.add_CoordinatorServiceServicer_to_server(CoordinatorServicer(config, registry), server)
    assert server.add_insecure_port(f"127.0.0.1:{port}") == port
    server.start()
    return server, registry


async def until(check: Callable[[], bool], timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        assert time.monotonic() < deadline, "condition not reached in time"
        await asyncio.sleep(0.02)


@pytest.mark.timeout(60)
def test_coordinator_loss_degrades_then_recovers(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(load_watcher, "REJOIN_GRACE_S", 1.0)
    port = free_port()

    async def main() -> None:
        server, registry = start_coordinator(port, ["a:1", "b:1"])
        balancer = Balancer("f", client_factory=StubClient)
        watcher = LoadWatcher(f"127.0.0.1:{port}", balancer)
        watcher.start()
        addresses = lambda: {c.address for c in balancer.clients}  # noqa: E731
        await until(lambda: addresses() == {"a:1", "b:1"})
        assert not balancer.degraded

        # Lost: the known engines keep serving, on our own counts.
        registry.close()
        server.stop(0).wait()
        await until(lambda: balancer.degraded)
        assert addresses() == {"a:1", "b:1"}
        assert {balancer.pick().address for _ in range(4)} == {"a:1", "b:1"}

        # Back after a restart, knowing only b so far: a stays during the grace period...
        server, registry = start_coordinator(port, ["b:1", "c:1"])
        await until(lambda: not balancer.degraded)
        await until(lambda: "c:1" in addresses())
        assert "a:1" in addresses()
        # ... and leaves once the coordinator has had the time to hear from everyone.
        await until(lambda: addresses() == {"b:1", "c:1"})
        await watcher.close()
        await balancer.close()
        registry.close()
        server.stop(0)

    asyncio.run(main())


class _FailingOnce(Balancer):
    """A Balancer whose first snapshot fails to apply, as a bug in it would."""

    failed = False

    async def update(self, *args: object, **kwargs: object) -> None:
        if not self.failed:
            self.failed = True
            raise RuntimeError("a bug while applying a snapshot")
        await super().update(*args, **kwargs)  # type: ignore[arg-type]


@pytest.mark.timeout(60)
def test_a_failure_applying_a_snapshot_does_not_end_the_watch() -> None:
    port = free_port()

    async def main() -> None:
        server, registry = start_coordinator(port, ["a:1"])
        balancer = _FailingOnce("f", client_factory=StubClient)
        watcher = LoadWatcher(f"127.0.0.1:{port}", balancer)
        watcher.start()
        await until(lambda: {c.address for c in balancer.clients} == {"a:1"})
        assert balancer.failed
        await watcher.close()
        await balancer.close()
        registry.close()
        server.stop(0)

    asyncio.run(main())
