"""Follows the coordinator's WatchLoad stream and hands each snapshot on.

If the coordinator goes away, the last snapshot stays in force (engines already
connected keep serving) and the watcher reconnects with backoff.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable

import grpc
from corestream.common.v1 import common_pb2
from corestream.coordinator.v1 import coordinator_service_pb2 as coordinator_pb2
from corestream.coordinator.v1 import coordinator_service_pb2_grpc as coordinator_pb2_grpc

from services.common.grpc_server import channel_options
from services.frontend.backoff import Backoff
from services.frontend.balancer import EngineLoadInfo

log = logging.getLogger(__name__)

_ENDED_STATES = (common_pb2.ENGINE_STATE_STOPPED, common_pb2.ENGINE_STATE_DEAD)


def load_info_from_proto(engine: coordinator_pb2.EngineLoad) -> EngineLoadInfo:
    return EngineLoadInfo(
        address=engine.address,
        routable=engine.state == common_pb2.ENGINE_STATE_RUNNING,
        alive=engine.state not in _ENDED_STATES,
        num_waiting=engine.num_waiting,
        num_running=engine.num_running,
    )


class LoadWatcher:
    def __init__(
        self,
        coordinator: str,
        on_snapshot: Callable[[list[EngineLoadInfo]], Awaitable[None]],
    ) -> None:
        self._coordinator = coordinator
        self._on_snapshot = on_snapshot
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name="watch-load")

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None

    async def _run(self) -> None:
        backoff = Backoff()
        async with grpc.aio.insecure_channel(
            self._coordinator, options=channel_options()
        ) as channel:
            stub = coordinator_pb2_grpc.CoordinatorServiceStub(channel)
            while True:
                try:
                    async for snapshot in stub.WatchLoad(coordinator_pb2.WatchLoadRequest()):
                        backoff.reset()
                        await self._on_snapshot([load_info_from_proto(e) for e in snapshot.engines])
                    reason = "stream ended"
                except grpc.aio.AioRpcError as e:
                    reason = f"{e.code().name}: {e.details()}"
                log.warning("WatchLoad on coordinator %s: %s; retrying", self._coordinator, reason)
                await asyncio.sleep(backoff.next_delay())
