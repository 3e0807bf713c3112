"""WeightSync: live weight updates across every engine, for AdminService and the HTTP
door's RL routes (vLLM's /start_weight_update, /update_weights, ...).

Each step fans one `weights_*` utility call out to the engines (see
services/engine/core/weight_updates.py) and makes the update atomic across them: the
tensors are staged on every engine first; a failure anywhere then aborts the update on
all of them, so every engine keeps the old weights and version. The switch itself is
hold all (no engine starts a step), commit all (each between two of its steps), release
all, so that no step anywhere runs while some engines serve the new weights and others
the old. Results are AdminService's `EngineResult`s, one per engine.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

import grpc
from corestream.generate.v1 import admin_service_pb2 as admin_pb2

from services.common.weight_version import next_version
from services.frontend.errors import RequestError, invalid_argument, unavailable
from services.frontend.routing.balancer import Balancer
from services.frontend.routing.engine_client import EngineClient

# Utilities run between two steps, so an engine normally answers within one step.
UTILITY_TIMEOUT_S = 10.0
# A pause in mode wait answers once the running requests finished.
PAUSE_WAIT_TIMEOUT_S = 600.0
# Receiving tensors, or joining a trainer's group, waits on the trainer.
TRANSFER_TIMEOUT_S = 3600.0
SLEEP_LEVELS = (1, 2)
WAKE_TAGS = ("kv_cache", "weights")

Results = list[admin_pb2.EngineResult]


def all_ok(results: Results) -> bool:
    return bool(results) and all(r.ok for r in results)


def result_json(result: admin_pb2.EngineResult) -> dict[str, Any]:
    return json.loads(result.result_json) if result.result_json else {}


class WeightSync:
    def __init__(self, balancer: Balancer, timeout_s: float = UTILITY_TIMEOUT_S,
                 transfer_timeout_s: float = TRANSFER_TIMEOUT_S) -> None:
        self._balancer = balancer
        self._timeout_s = timeout_s
        self._transfer_timeout_s = transfer_timeout_s
        # One update at a time through this frontend: its steps must not interleave.
        self._lock = asyncio.Lock()

    def clients(self, engine_index: int | None = None) -> list[EngineClient]:
        """The connected engines (or the one with `engine_index`), in index order; raises
        RequestError NOT_FOUND / UNAVAILABLE when there are none."""
        clients = [c for c in self._balancer.clients if c.connected]
        if engine_index is not None:
            clients = [c for c in clients if c.engine_index == engine_index]
            if not clients:
                raise RequestError(grpc.StatusCode.NOT_FOUND,
                                   f"no connected engine has index {engine_index}")
        if not clients:
            raise unavailable("no engine is connected")
        return sorted(clients, key=lambda c: c.engine_index or 0)

    async def call(self, clients: list[EngineClient], method: str, args: dict[str, Any],
                   timeout_s: float | None = None) -> Results:
        """`method` on every client at once; one result each, in their order."""
        return list(await asyncio.gather(*(
            self._call_one(c, method, args, timeout_s or self._timeout_s) for c in clients)))

    async def update_from_disk(self, path: str, version: str | None) -> tuple[Results, str]:
        """A checkpoint folder onto every engine; (results, the version served after)."""
        async with self._lock:
            clients = self.clients()
            results = await self.call(clients, "weights_start", {})
            if all_ok(results):
                results = await self.call(clients, "weights_stage",
                                          {"source": "disk", "path": path},
                                          self._transfer_timeout_s)
            if not all_ok(results):
                await self.call(clients, "weights_abort", {})
                return results, self._balancer.weight_version
            return await self._switch(clients, version)

    async def init_transfer(self, master_address: str, master_port: int, rank_offset: int,
                            world_size: int, timeout_s: float | None) -> Results:
        """Every engine's ranks join the trainer's group, engines in index order taking
        consecutive ranks from `rank_offset` on."""
        async with self._lock:
            clients = self.clients()
            infos = await self.call(clients, "weights_info", {})
            if not all_ok(infos):
                return infos
            offsets = []
            offset = rank_offset
            for info in infos:
                offsets.append(offset)
                offset += int(result_json(info).get("tensor_parallel_size", 1))
            args = {"master_address": master_address, "master_port": master_port,
                    "world_size": world_size,
                    **({"timeout_s": timeout_s} if timeout_s is not None else {})}
            return list(await asyncio.gather(*(
                self._call_one(c, "weights_init_transfer", {**args, "rank_offset": o},
                               self._transfer_timeout_s)
                for c, o in zip(clients, offsets, strict=True))))

    async def start(self) -> Results:
        async with self._lock:
            clients = self.clients()
            results = await self.call(clients, "weights_start", {})
            if not all_ok(results):
                # Those that opened must not keep an update the others refused.
                await self.call([c for c, r in zip(clients, results, strict=True) if r.ok],
                                "weights_abort", {})
            return results

    async def stage(self, args: dict[str, Any]) -> Results:
        """Tensors into the open update on every engine; a failure anywhere aborts it."""
        async with self._lock:
            clients = self.clients()
            results = await self.call(clients, "weights_stage", args, self._transfer_timeout_s)
            if not all_ok(results):
                await self.call(clients, "weights_abort", {})
            return results

    async def finish(self, version: str | None) -> tuple[Results, str]:
        async with self._lock:
            return await self._switch(self.clients(), version)

    async def abort(self) -> Results:
        async with self._lock:
            return await self.call(self.clients(), "weights_abort", {})

    # ---- sleep (services/engine/core/sleep.py) -------------------------------------

    async def sleep(self, level: int, engine_index: int | None = None) -> Results:
        """Level 1 frees every engine's KV cache, level 2 its weights too."""
        if level not in SLEEP_LEVELS:
            raise invalid_argument("level", f"level must be 1 (free the KV cache) or 2 (the "
                                   f"weights too), got {level}")
        async with self._lock:  # not in the middle of an update's steps
            return await self.call(self.clients(engine_index), "sleep", {"level": level})

    async def wake_up(self, tags: list[str], engine_index: int | None = None) -> Results:
        """Restore what sleep freed, by tag (both when `tags` is empty)."""
        if unknown := [t for t in tags if t not in WAKE_TAGS]:
            raise invalid_argument("tags", f"unknown tag {unknown[0]!r}: tags are "
                                   f"{', '.join(WAKE_TAGS)}")
        async with self._lock:
            # Dropped weights come back by a reload of the checkpoint: an update's time.
            return await self.call(self.clients(engine_index), "wake_up",
                                   {"tags": tags or list(WAKE_TAGS)}, self._transfer_timeout_s)

    async def sleep_info(self, engine_index: int | None = None) -> Results:
        return await self.call(self.clients(engine_index), "sleep_info", {})

    async def _switch(self, clients: list[EngineClient], version: str | None
                      ) -> tuple[Results, str]:
        args = {} if version is None else {"weight_version": version}
        if len(clients) == 1:
            results = await self.call(clients, "weights_commit", args)
            return results, self._balancer.weight_version
        held = await self.call(clients, "weights_hold", {})
        if not all_ok(held):
            await self.call(clients, "weights_release", {})
            await self.call(clients, "weights_abort", {})
            return held, self._balancer.weight_version
        if version is None:
            # Every engine must take the same version: the first one's next.
            infos = await self.call(clients[:1], "weights_info", {})
            current = result_json(infos[0]).get("weight_version", "0") if all_ok(infos) else "0"
            args = {"weight_version": next_version(str(current))}
        try:
            results = await self.call(clients, "weights_commit", args)
        finally:
            await self.call(clients, "weights_release", {})
        return results, self._balancer.weight_version

    async def _call_one(self, client: EngineClient, method: str, args: dict[str, Any],
                        timeout_s: float) -> admin_pb2.EngineResult:
        result = admin_pb2.EngineResult(engine_index=client.engine_index or 0,
                                        address=client.address)
        try:
            outcome = await client.call_utility(method, args, timeout_s)
        except TimeoutError:
            result.code = grpc.StatusCode.DEADLINE_EXCEEDED.value[0]
            result.message = f"{client.name} did not answer {method!r} within {timeout_s:g} s"
            return result
        except RequestError as e:
            result.code = e.code.value[0]
            result.message = e.message
            return result
        if outcome.failure_message:
            result.code = grpc.StatusCode.FAILED_PRECONDITION.value[0]
            result.message = outcome.failure_message
        else:
            result.ok = True
            result.result_json = outcome.result_json
        return result
