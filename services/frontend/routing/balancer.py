"""Which engines exist, which take new requests, and which one gets the next.

The balancer owns one `EngineClient` per known engine. Engines come from the
coordinator's load snapshots (`update`) or from a static list (`set_static`). An
engine that leaves the snapshot, or stops running, takes no new requests; its
client stays open until its in-flight requests finish, so a draining engine can
complete them.

Routing follows the policy (see policies.py): by default the lowest cost of load
plus the prefill an engine would still do, from the engines' prefix-cache events
(prefix_index.py); else the lowest `load_score`, or a plain rotation. A load
snapshot lags behind our own routing (engine report, then the coordinator's rate
limit), so the requests we sent since the snapshot before last count too, while
still in flight: without them a burst would all land on the engine that looked
idlest. Equal scores rotate,
so an idle cluster spreads requests evenly. Without load figures (static engines, or the
coordinator out of reach: `degraded`) the score is our own in-flight count on
each engine, which is exact for a single frontend.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from services.common.block_hash import BlockHash, prompt_block_hashes
from services.frontend.errors import invalid_argument, unavailable
from services.frontend.routing import policies
from services.frontend.routing.engine_client import EngineClient
from services.frontend.routing.policies import Option, RoutingPolicy
from services.frontend.routing.prefix_index import PrefixIndex

log = logging.getLogger(__name__)

# A waiting request costs more than a running one: it has not even been scheduled.
WAITING_WEIGHT = 4.0
# Past this KV-cache usage a waiting request may wait for blocks to free (or cause a
# preemption), so waiting costs up to 1 + KV_PRESSURE_WEIGHT times more at a full cache.
KV_PRESSURE_THRESHOLD = 0.8
KV_PRESSURE_WEIGHT = 4.0
# Uncached prompt tokens that weigh as much as one more running request (cache_aware).
PREFILL_TOKENS_PER_REQUEST = 64.0


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
    kv_cache_usage: float = 0.0
    engine_index: int | None = None
    """The engine's data-parallel rank, when the snapshot tells it."""
    tensor_parallel_size: int = 0
    """Ranks the engine's model runs over (0 = not told)."""
    sleep_level: int = 0
    """0 awake; 1 or 2 asleep: it queues requests until woken."""


def waiting_cost(kv_cache_usage: float) -> float:
    """What one waiting request adds to the score at this KV-cache usage."""
    pressure = max(0.0, kv_cache_usage - KV_PRESSURE_THRESHOLD) / (1 - KV_PRESSURE_THRESHOLD)
    return WAITING_WEIGHT * (1 + KV_PRESSURE_WEIGHT * min(pressure, 1.0))


def load_score(load: EngineLoadInfo, num_unseen: int = 0) -> float:
    """How busy an engine is, lower is better. `num_unseen` requests were sent there
    after the snapshot was taken; they run at once on an engine that queues nothing,
    and queue where others already queue."""
    cost = waiting_cost(load.kv_cache_usage)
    unseen_cost = cost if load.num_waiting else 1.0
    return load.num_running + load.num_waiting * cost + num_unseen * unseen_cost


@dataclass(frozen=True)
class Route:
    """The engine chosen for a request, and why."""

    client: EngineClient
    reason: str
    cached_tokens: int = 0
    """Leading prompt tokens the index says the engine holds (predicted cache hit)."""


class _Unseen:
    """Requests sent to one engine in the current and the previous snapshot period.
    Those older than the snapshot before last are in the engine's reported load."""

    __slots__ = ("current", "previous")

    def __init__(self) -> None:
        self.current = 0
        self.previous = 0

    @property
    def count(self) -> int:
        return self.current + self.previous

    def next_snapshot(self) -> None:
        self.previous, self.current = self.current, 0


class Balancer:
    def __init__(
        self,
        frontend_id: str,
        on_readiness: Callable[[bool], None] | None = None,
        client_factory: Callable[..., EngineClient] = EngineClient,
        policy: RoutingPolicy = RoutingPolicy.LEAST_LOAD,
        prefix_index: PrefixIndex | None = None,
        prefill_tokens_per_request: float = PREFILL_TOKENS_PER_REQUEST,
    ) -> None:
        self.policy = policy
        self.prefix_index = prefix_index
        if policy is RoutingPolicy.CACHE_AWARE and prefix_index is None:
            self.prefix_index = PrefixIndex()
        self._prefill_tokens_per_request = prefill_tokens_per_request
        self._frontend_id = frontend_id
        self._on_readiness = on_readiness
        self._client_factory = client_factory
        self._clients: dict[str, EngineClient] = {}
        self._loads: dict[str, EngineLoadInfo] = {}
        self._unseen: dict[str, _Unseen] = {}
        self._seen_ranks: set[int] = set()
        self._has_load_figures = False
        self._degraded_reason = ""
        self._last_pick = ""
        self._ready = False

    @property
    def ready(self) -> bool:
        return self._ready

    @property
    def degraded(self) -> bool:
        """The coordinator is out of reach: routing on our own counts over the engines
        last known."""
        return bool(self._degraded_reason)

    @property
    def clients(self) -> list[EngineClient]:
        """Every engine's client, routable or not (admin calls reach draining ones too)."""
        return list(self._clients.values())

    @property
    def num_connected(self) -> int:
        return sum(c.connected for c in self._clients.values())

    @property
    def tensor_parallel_size(self) -> int:
        """Ranks per engine among the live engines of the latest snapshot: the largest
        if they differ (they normally agree), 0 if none told it (no snapshot yet, static
        engines, engines too old to report it)."""
        return max((e.tensor_parallel_size for e in self._loads.values()), default=0)

    @property
    def weight_version(self) -> str:
        """The version of the weights the connected engines serve; several, sorted and
        comma-separated, while an update is switching them; "" before any engine said."""
        versions = sorted({c.weight_version for c in self.clients
                           if c.connected and c.weight_version})
        return ",".join(versions)

    def engine_loads(self) -> list[tuple[EngineClient, EngineLoadInfo | None]]:
        """Every engine's client with its latest load figures (None where there are no
        fresh ones: static engines, or the coordinator out of reach). Safe to call from
        another thread: it copies."""
        fresh = self._has_load_figures and not self.degraded
        loads = dict(self._loads) if fresh else {}
        return [(client, loads.get(address)) for address, client in list(self._clients.items())]

    async def set_static(self, addresses: Iterable[str]) -> None:
        await self._apply([EngineLoadInfo(a, routable=True, alive=True) for a in addresses])
        self._has_load_figures = False

    async def update(self, engines: Iterable[EngineLoadInfo], retire: bool = True) -> None:
        """Apply a coordinator snapshot: open clients for new engines and, with `retire`,
        retire those the snapshot lacks (a coordinator that just restarted does not know
        every engine yet: keep them then)."""
        engines = list(engines)
        if not retire:
            fresh = {e.address for e in engines}
            engines += [e for a, e in self._loads.items() if a not in fresh]
        for unseen in self._unseen.values():
            unseen.next_snapshot()
        self._has_load_figures = True
        self.set_degraded("")
        await self._apply(engines)

    def set_degraded(self, reason: str) -> None:
        """Enter (a reason) or leave ("") the degraded state; logged once each way."""
        if bool(reason) != self.degraded:
            if reason:
                log.warning("degraded: %s; routing on our own in-flight counts over the %d "
                            "engines already known until the coordinator is back",
                            reason, len(self._clients))
            else:
                log.info("the coordinator is back: routing on its load snapshots again")
        self._degraded_reason = reason
        self._refresh()

    def pick(self, data_parallel_rank: int | None = None) -> EngineClient:
        return self.route(data_parallel_rank).client

    def route(self, data_parallel_rank: int | None = None,
              prompt_token_ids: Sequence[int] = (), cache_salt: str = "",
              exclude: Iterable[str] = ()) -> Route:
        """The engine for the next request, among those accepting requests (the pinned
        rank's, if any) but the `exclude`d addresses, by the routing policy; ties in
        rotation."""
        excluded = set(exclude)
        candidates = [
            (address, client) for address, client in self._clients.items()
            if client.accepting and self._routable(address, client) and address not in excluded
        ]
        if data_parallel_rank is not None:
            candidates = self._pinned(data_parallel_rank, candidates)
        # A sleeping engine queues what it gets until woken: only when all sleep.
        awake = [(a, c) for a, c in candidates if not self._asleep(a)]
        candidates = awake or candidates
        if not candidates:
            raise unavailable(
                "no engine is available to serve the request "
                f"({self.num_connected} connected, {len(self._clients)} known); retry later"
            )
        # Start after the engine picked last, so that equal scores take turns.
        start = next((i + 1 for i, (address, _) in enumerate(candidates)
                      if address == self._last_pick), 0)
        ordered = candidates[start:] + candidates[:start]
        hashes: dict[int, list[BlockHash]] = {}
        if self.policy is RoutingPolicy.ROUND_ROBIN:
            choice, cached = policies.Choice(0, "round_robin"), [0] * len(ordered)
        else:
            loads = [self._score(address, client) for address, client in ordered]
            if self.policy is RoutingPolicy.CACHE_AWARE and prompt_token_ids:
                cached = self._cached_tokens(ordered, prompt_token_ids, cache_salt, hashes)
                choice = policies.cache_aware(
                    [Option(load, c) for load, c in zip(loads, cached, strict=True)],
                    len(prompt_token_ids), self._prefill_tokens_per_request)
            else:
                cached = [0] * len(ordered)
                choice = policies.least_load([Option(load) for load in loads])
        address, client = ordered[choice.index]
        self._last_pick = address
        self._unseen.setdefault(address, _Unseen()).current += 1
        if self.prefix_index is not None:
            block_size = self.prefix_index.block_size(address)
            if block_size in hashes:
                self.prefix_index.predict(address, hashes[block_size])
        return Route(client, choice.reason, cached[choice.index])

    def _cached_tokens(self, ordered: list[tuple[str, EngineClient]],
                       prompt_token_ids: Sequence[int], cache_salt: str,
                       hashes: dict[int, list[BlockHash]]) -> list[int]:
        """Each engine's cached prompt tokens by the index; fills `hashes` (the prompt's
        block hashes by block size, usually one size for all engines)."""
        index = self.prefix_index
        assert index is not None
        by_size: dict[int, list[str]] = {}
        for address, _ in ordered:
            block_size = index.block_size(address)
            if block_size is not None:
                by_size.setdefault(block_size, []).append(address)
        tokens: dict[str, int] = {}
        for block_size, addresses in by_size.items():
            hashes[block_size] = prompt_block_hashes(prompt_token_ids, block_size, cache_salt)
            for address, blocks in index.match(hashes[block_size], addresses).items():
                tokens[address] = blocks * block_size
        return [tokens.get(address, 0) for address, _ in ordered]

    async def close(self) -> None:
        clients, self._clients = self._clients, {}
        await asyncio.gather(*(c.close() for c in clients.values()))
        if self.prefix_index is not None:
            for address in clients:
                self.prefix_index.drop_engine(address)
        self._refresh()

    async def _apply(self, engines: list[EngineLoadInfo]) -> None:
        self._loads = {e.address: e for e in engines if e.alive}
        for address, load in self._loads.items():
            if load.engine_index is not None:
                self._seen_ranks.add(load.engine_index)
            if address not in self._clients:
                log.info("engine %s appeared", address)
                extra: dict[str, Any] = (
                    {"prefix_index": self.prefix_index} if self.prefix_index is not None else {})
                client = self._client_factory(address, self._frontend_id, self._refresh,
                                              **extra)
                self._clients[address] = client
                client.start()
        await self._close_retired()
        self._refresh()

    def _routable(self, address: str, client: EngineClient) -> bool:
        if self.degraded:
            return True  # the snapshot is stale; the Session's own state decides
        load = self._loads.get(address)
        if load is None:
            return False
        # The engine tells its Session of each change of state as it happens; the
        # coordinator relays the same a report and a snapshot later. A client that was
        # pinned to an engine the moment it recovered must not be refused on the older.
        running = client.running
        return load.routable if running is None else running

    def _asleep(self, address: str) -> bool:
        load = self._loads.get(address)
        return load is not None and load.sleep_level > 0 and not self.degraded

    def _score(self, address: str, client: EngineClient) -> float:
        load = self._loads.get(address)
        if self.degraded or not self._has_load_figures or load is None:
            return float(client.num_in_flight)
        unseen = self._unseen.get(address)
        # Of the requests sent since the snapshot, those already finished load nothing:
        # at most our in-flight ones are still there.
        num_unseen = min(unseen.count, client.num_in_flight) if unseen is not None else 0
        return load_score(load, num_unseen)

    def _rank(self, address: str, client: EngineClient) -> int | None:
        load = self._loads.get(address)
        if load is not None and load.engine_index is not None:
            return load.engine_index
        return client.engine_index

    def _pinned(
        self, rank: int, candidates: list[tuple[str, EngineClient]]
    ) -> list[tuple[str, EngineClient]]:
        pinned = [(a, c) for a, c in candidates if self._rank(a, c) == rank]
        if pinned:
            return pinned
        self._seen_ranks.update(
            r for a, c in self._clients.items() if (r := self._rank(a, c)) is not None)
        if rank in self._seen_ranks:
            raise unavailable(
                f"data_parallel_rank {rank}: that engine is down, draining or paused by a "
                "fault; retry later, or leave data_parallel_rank unset to use any engine")
        known = sorted(self._seen_ranks)
        raise invalid_argument(
            "data_parallel_rank",
            f"data_parallel_rank {rank} names no engine (known ranks: "
            f"{', '.join(map(str, known)) or 'none yet'})",
        )

    async def _close_retired(self) -> None:
        retired = [
            address
            for address, client in self._clients.items()
            if address not in self._loads and client.num_in_flight == 0
        ]
        for address in retired:
            log.info("engine %s left; closing its session", address)
            self._unseen.pop(address, None)
            await self._clients.pop(address).close()
            if self.prefix_index is not None:
                self.prefix_index.drop_engine(address)

    def _refresh(self) -> None:
        # Ready exactly when pick() would find an engine.
        ready = any(c.accepting and self._routable(a, c) for a, c in self._clients.items())
        if ready != self._ready:
            self._ready = ready
            log.info("ready: %s (%d engines connected)", ready, self.num_connected)
            if self._on_readiness is not None:
                self._on_readiness(ready)
