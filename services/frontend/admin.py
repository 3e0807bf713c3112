"""The public AdminService: operator calls fanned out to the engines as utility calls.

Each RPC picks the engines (all those the balancer knows, or the one whose DP rank
the request names), sends the utility over each engine's Session concurrently and
returns one EngineResult per engine. One engine failing, refusing or not answering
in time is reported in its own result; the RPC itself fails only when there is no
engine to ask (UNAVAILABLE) or the named one is unknown (NOT_FOUND).

Under `corestream serve` (--restart-status-file), GetEngineStats also reports how
often serve restarted each process, and an engine serve gave up on (a crash loop)
as a failed result of its own: it is gone for good, not merely slow to answer.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any, Protocol

import grpc
from corestream.generate.v1 import admin_service_pb2 as admin_pb2
from corestream.generate.v1 import admin_service_pb2_grpc as admin_pb2_grpc

from services.common.restart_status import PartStatus, read_status
from services.frontend.errors import RequestError
from services.frontend.routing.balancer import Balancer
from services.frontend.routing.engine_client import EngineClient

SERVICE_NAME = admin_pb2.DESCRIPTOR.services_by_name["AdminService"].full_name
# Utilities run between two steps, so an engine normally answers within one step.
UTILITY_TIMEOUT_S = 10.0

_PAUSE_MODES = {
    admin_pb2.PAUSE_MODE_UNSPECIFIED: "wait",
    admin_pb2.PAUSE_MODE_ABORT: "abort",
    admin_pb2.PAUSE_MODE_WAIT: "wait",
    admin_pb2.PAUSE_MODE_KEEP: "keep",
}


class _EngineFilter(Protocol):
    def HasField(self, field_name: str) -> bool: ...  # noqa: N802 (protobuf API)

    @property
    def engine_index(self) -> int: ...


class AdminServicer(admin_pb2_grpc.AdminServiceServicer):
    def __init__(self, balancer: Balancer, timeout_s: float = UTILITY_TIMEOUT_S,
                 restart_status_file: str = "") -> None:
        self._balancer = balancer
        self._timeout_s = timeout_s
        self._restart_status = Path(restart_status_file) if restart_status_file else None

    async def ResetPrefixCache(  # noqa: N802 (gRPC method name)
        self, request: admin_pb2.ResetPrefixCacheRequest, context: grpc.aio.ServicerContext
    ) -> admin_pb2.ResetPrefixCacheResponse:
        results = await self._call_all(request, context, "reset_prefix_cache", {})
        return admin_pb2.ResetPrefixCacheResponse(results=results)

    async def GetEngineStats(  # noqa: N802 (gRPC method name)
        self, request: admin_pb2.GetEngineStatsRequest, context: grpc.aio.ServicerContext
    ) -> admin_pb2.GetEngineStatsResponse:
        parts = read_status(self._restart_status) if self._restart_status else []
        lost = [_given_up_result(p) for p in parts if p.engine_given_up]
        lost = [r for r in lost if not request.HasField("engine_index")
                or r.engine_index == request.engine_index]
        if lost and (request.HasField("engine_index") or not self._balancer.num_connected):
            results = lost  # nothing else to ask
        else:
            results = await self._call_all(request, context, "get_stats", {}) + lost
        return admin_pb2.GetEngineStatsResponse(
            results=sorted(results, key=lambda r: r.engine_index),
            restarts=[admin_pb2.ProcessRestarts(part=p.part, restarts=p.restarts,
                                                last_exit=p.last_exit, given_up=p.given_up)
                      for p in parts])

    async def PauseScheduling(  # noqa: N802 (gRPC method name)
        self, request: admin_pb2.PauseSchedulingRequest, context: grpc.aio.ServicerContext
    ) -> admin_pb2.PauseSchedulingResponse:
        mode = _PAUSE_MODES.get(request.mode)
        if mode is None:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                f"mode {request.mode} is not a PauseMode")
        results = await self._call_all(request, context, "pause", {"mode": mode})
        return admin_pb2.PauseSchedulingResponse(results=results)

    async def ResumeScheduling(  # noqa: N802 (gRPC method name)
        self, request: admin_pb2.ResumeSchedulingRequest, context: grpc.aio.ServicerContext
    ) -> admin_pb2.ResumeSchedulingResponse:
        results = await self._call_all(request, context, "resume", {})
        return admin_pb2.ResumeSchedulingResponse(results=results)

    async def StartProfile(  # noqa: N802 (gRPC method name)
        self, request: admin_pb2.StartProfileRequest, context: grpc.aio.ServicerContext
    ) -> admin_pb2.StartProfileResponse:
        results = await self._call_all(request, context, "profile", {"action": "start"})
        return admin_pb2.StartProfileResponse(results=results)

    async def StopProfile(  # noqa: N802 (gRPC method name)
        self, request: admin_pb2.StopProfileRequest, context: grpc.aio.ServicerContext
    ) -> admin_pb2.StopProfileResponse:
        results = await self._call_all(request, context, "profile", {"action": "stop"})
        return admin_pb2.StopProfileResponse(results=results)

    async def _call_all(self, request: _EngineFilter, context: grpc.aio.ServicerContext,
                        method: str, args: dict[str, Any]) -> list[admin_pb2.EngineResult]:
        clients = [c for c in self._balancer.clients if c.connected]
        if request.HasField("engine_index"):
            clients = [c for c in clients if c.engine_index == request.engine_index]
            if not clients:
                await context.abort(grpc.StatusCode.NOT_FOUND,
                                    f"no connected engine has index {request.engine_index}")
        if not clients:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "no engine is connected")
        results = await asyncio.gather(*(self._call_one(c, method, args) for c in clients))
        return sorted(results, key=lambda r: r.engine_index)

    async def _call_one(self, client: EngineClient, method: str,
                        args: dict[str, Any]) -> admin_pb2.EngineResult:
        result = admin_pb2.EngineResult(engine_index=client.engine_index or 0,
                                        address=client.address)
        try:
            outcome = await client.call_utility(method, args, self._timeout_s)
        except TimeoutError:
            result.code = grpc.StatusCode.DEADLINE_EXCEEDED.value[0]
            result.message = (f"{client.name} did not answer {method!r} within "
                              f"{self._timeout_s:g} s")
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


def _given_up_result(part: PartStatus) -> admin_pb2.EngineResult:
    return admin_pb2.EngineResult(
        engine_index=int(part.part.removeprefix("engine-")),
        code=grpc.StatusCode.UNAVAILABLE.value[0],
        message=f"corestream serve gave up on {part.part} after {part.restarts} restart(s) "
                f"(a crash loop; last exit {part.last_exit}); the cluster serves without it")
