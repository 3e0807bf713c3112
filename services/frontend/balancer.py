"""Which engines exist, which take new requests, and which one gets the next.

The balancer owns one `EngineClient` per known engine. Engines come from the
coordinator's load snapshots (`update`) or from a static list (`set_static`). An
engine that leaves the snapshot, or stops running, takes no new requests; its
client stays open until its in-flight requests finish, so a draining engine can
complete them.
"""

from __future__ import annotations

import asyncio
import logging
import random
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from services.frontend.engine_client import EngineClient
from services.frontend.errors import unavailable

log = logging.getLogger(__name__)

# A waiting request costs more than a running one: it has not even been scheduled.
WAITING_WEIGHT = 4


@dataclass(frozen=True)
class EngineLoadInfo:
    """One engine in a load snapshot."""

    address: str
    routable: bool
    """Running and accepting new requests."""
    alive: bool
    """Not stopped or dead: requests already there may still finish."""
    num_waiting: int = 0
    num_running: int = 0


class Balancer:
    def __init__(
        self,
        frontend_id: str,
        on_readiness: Callable[[bool], None] | None = None,
        client_factory: Callable[..., EngineClient] = EngineClient,
    ) -> None:
        self._frontend_id = frontend_id
        self._on_readiness = on_readiness
        self._client_factory = client_factory
        self._clients: dict[str, EngineClient] = {}
        self._loads: dict[str, EngineLoadInfo] = {}
        self._ready = False

    @property
    def ready(self) -> bool:
        return self._ready

    @property
    def clients(self) -> list[EngineClient]:
        """Every engine's client, routable or not (admin calls reach draining ones too)."""
        return list(self._clients.values())

    @property
    def num_connected(self) -> int:
        return sum(c.connected for c in self._clients.values())

    async def set_static(self, addresses: Iterable[str]) -> None:
        await self.update(EngineLoadInfo(a, routable=True, alive=True) for a in addresses)

    async def update(self, engines: Iterable[EngineLoadInfo]) -> None:
        """Apply a snapshot: open clients for new engines, retire vanished ones."""
        self._loads = {e.address: e for e in engines if e.alive}
        for address in self._loads:
            if address not in self._clients:
                log.info("engine %s appeared", address)
                client = self._client_factory(address, self._frontend_id, self._refresh)
                self._clients[address] = client
                client.start()
        await self._close_retired()
        self._refresh()

    def pick(self) -> EngineClient:
        """The least loaded engine that accepts requests, counting local in-flight ones
        because snapshots lag behind our own routing."""
        best: EngineClient | None = None
        best_key: tuple[int, float] | None = None
        for address, client in self._clients.items():
            load = self._loads.get(address)
            if load is None or not load.routable or not client.accepting:
                continue
            score = load.num_waiting * WAITING_WEIGHT + load.num_running + client.num_in_flight
            key = (score, random.random())
            if best_key is None or key < best_key:
                best, best_key = client, key
        if best is None:
            raise unavailable(
                "no engine is available to serve the request "
                f"({self.num_connected} connected, {len(self._clients)} known); retry later"
            )
        return best

    async def close(self) -> None:
        clients, self._clients = self._clients, {}
        await asyncio.gather(*(c.close() for c in clients.values()))
        self._refresh()

    async def _close_retired(self) -> None:
        retired = [
            address
            for address, client in self._clients.items()
            if address not in self._loads and client.num_in_flight == 0
        ]
        for address in retired:
            log.info("engine %s left; closing its session", address)
            await self._clients.pop(address).close()

    def _refresh(self) -> None:
        ready = any(c.accepting for c in self._clients.values())
        if ready != self._ready:
            self._ready = ready
            log.info("ready: %s (%d engines connected)", ready, self.num_connected)
            if self._on_readiness is not None:
                self._on_readiness(ready)
