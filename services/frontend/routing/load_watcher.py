"""Follows the coordinator's WatchLoad stream and hands each snapshot to the balancer.

If the coordinator goes away, the balancer turns degraded: the engines already
known keep serving (their Sessions do not depend on the coordinator), routed on
the frontend's own in-flight counts, while the watcher reconnects with backoff.
A coordinator that comes back after a restart knows no engine until each has
registered again, so for REJOIN_GRACE_S after a reconnect the snapshots only add
engines and the ones missing from them stay.
"""

from __future__ import annotations

import asyncio
import logging
import time

import grpc
from corestream.common.v1 import common_pb2
from corestream.coordinator.v1 import coordinator_service_pb2 as coordinator_pb2
from corestream.coordinator.v1 import coordinator_service_pb2_grpc as coordinator_pb2_grpc

from services.common.backoff import Backoff
from services.common.grpc_server import make_aio_channel
from services.common.security_config import PLAINTEXT, SecurityConfig
from services.common.tasks import cancel_and_wait
from services.frontend.routing.balancer import Balancer, EngineLoadInfo

log = logging.getLogger(__name__)

_ENDED_STATES = (common_pb2.ENGINE_STATE_STOPPED, common_pb2.ENGINE_STATE_DEAD)
# Engines retry their registration with a backoff of at most 2 s (plus jitter).
REJOIN_GRACE_S = 5.0


def load_info_from_proto(engine: coordinator_pb2.EngineLoad) -> EngineLoadInfo:
    return EngineLoadInfo(
        address=engine.address,
        routable=engine.state == common_pb2.ENGINE_STATE_RUNNING,
        alive=engine.state not in _ENDED_STATES,
        num_waiting=engine.num_waiting,
        num_running=engine.num_running,
        kv_cache_usage=engine.kv_cache_usage,
        engine_index=engine.engine_index,
        tensor_parallel_size=engine.tensor_parallel_size,
        sleep_level=engine.sleep_level,
    )


class LoadWatcher:
    def __init__(self, coordinator: str, balancer: Balancer,
                 security: SecurityConfig = PLAINTEXT) -> None:
        self._coordinator = coordinator
        self._security = security
        self._balancer = balancer
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name="watch-load")

    async def close(self) -> None:
        await cancel_and_wait(self._task)
        self._task = None

    async def _run(self) -> None:
        backoff = Backoff()
        rejoining = False
        async with make_aio_channel(self._coordinator, self._security) as channel:
            stub = coordinator_pb2_grpc.CoordinatorServiceStub(channel)
            while True:
                try:
                    await self._follow(stub, backoff, rejoining)
                    reason = "its WatchLoad stream ended"
                except grpc.aio.AioRpcError as e:
                    reason = f"{e.code().name}: {e.details()}"
                except Exception as e:
                    # A bug while applying a snapshot must not end the watch: routing
                    # would then never learn of an engine again. Log it, follow anew.
                    log.exception("applying the coordinator's load snapshot failed")
                    reason = repr(e)
                rejoining = True
                self._balancer.set_degraded(f"coordinator {self._coordinator} lost ({reason})")
                delay = backoff.next_delay()
                log.debug("WatchLoad on %s: %s; retrying in %.1f s",
                          self._coordinator, reason, delay)
                await asyncio.sleep(delay)

    async def _follow(
        self, stub: coordinator_pb2_grpc.CoordinatorServiceStub, backoff: Backoff,
        rejoining: bool,
    ) -> None:
        opened_at: float | None = None
        async for snapshot in stub.WatchLoad(coordinator_pb2.WatchLoadRequest()):
            now = time.monotonic()
            if opened_at is None:
                opened_at = now
                backoff.reset()
            retire = not rejoining or now - opened_at >= REJOIN_GRACE_S
            await self._balancer.update(
                [load_info_from_proto(e) for e in snapshot.engines], retire=retire)
