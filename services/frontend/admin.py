"""The public AdminService: operator calls fanned out to the engines as utility calls.

Live weight updates go through `weight_sync.WeightSync`, which makes them atomic
across the engines (staged everywhere, then switched everywhere at once).

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

import json
from collections.abc import Awaitable
from pathlib import Path
from typing import Any, Protocol, TypeVar

import grpc
from corestream.generate.v1 import admin_service_pb2 as admin_pb2
from corestream.generate.v1 import admin_service_pb2_grpc as admin_pb2_grpc

from services.common.restart_status import PartStatus, read_status
from services.common.weight_version import check_weight_version
from services.frontend.errors import RequestError
from services.frontend.routing.balancer import Balancer
from services.frontend.weight_sync import (
    PAUSE_WAIT_TIMEOUT_S,
    UTILITY_TIMEOUT_S,
    WeightSync,
    all_ok,
    result_json,
)

SERVICE_NAME = admin_pb2.DESCRIPTOR.services_by_name["AdminService"].full_name

_PAUSE_MODES = {
    admin_pb2.PAUSE_MODE_UNSPECIFIED: "wait",
    admin_pb2.PAUSE_MODE_ABORT: "abort",
    admin_pb2.PAUSE_MODE_WAIT: "wait",
    admin_pb2.PAUSE_MODE_KEEP: "keep",
}


T = TypeVar("T")


class _VersionCarrier(Protocol):
    def HasField(self, field_name: str) -> bool: ...  # noqa: N802 (protobuf API)

    @property
    def weight_version(self) -> str: ...


class _EngineFilter(Protocol):
    def HasField(self, field_name: str) -> bool: ...  # noqa: N802 (protobuf API)

    @property
    def engine_index(self) -> int: ...


class AdminServicer(admin_pb2_grpc.AdminServiceServicer):
    def __init__(self, balancer: Balancer, timeout_s: float = UTILITY_TIMEOUT_S,
                 restart_status_file: str = "", weight_sync: WeightSync | None = None) -> None:
        self._balancer = balancer
        self._timeout_s = timeout_s
        self._sync = weight_sync or WeightSync(balancer, timeout_s)
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
        timeout_s = self._timeout_s
        if request.HasField("timeout_s"):
            if not 0 < request.timeout_s <= PAUSE_WAIT_TIMEOUT_S:
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, (
                    f"timeout_s must be in (0, {PAUSE_WAIT_TIMEOUT_S:g}] seconds, "
                    f"got {request.timeout_s}"))
            timeout_s = request.timeout_s
        elif mode == "wait":
            timeout_s = PAUSE_WAIT_TIMEOUT_S
        results = await self._call_all(request, context, "pause",
                                       {"mode": mode, "clear_cache": request.clear_cache},
                                       timeout_s)
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

    async def IsPaused(  # noqa: N802 (gRPC method name)
        self, request: admin_pb2.IsPausedRequest, context: grpc.aio.ServicerContext
    ) -> admin_pb2.IsPausedResponse:
        stats = await self._call_all(request, context, "get_stats", {})
        results = [admin_pb2.EngineResult(
            engine_index=r.engine_index, address=r.address, ok=r.ok, code=r.code,
            message=r.message, result_json=json.dumps(
                {"paused": result_json(r).get("paused")}) if r.ok else "") for r in stats]
        return admin_pb2.IsPausedResponse(
            results=results,
            is_paused=all_ok(results) and all(result_json(r)["paused"] for r in results))

    # ---- live weight updates (weight_sync.py) ------------------------------------

    async def UpdateWeightsFromDisk(  # noqa: N802 (gRPC method name)
        self, request: admin_pb2.UpdateWeightsFromDiskRequest,
        context: grpc.aio.ServicerContext,
    ) -> admin_pb2.UpdateWeightsFromDiskResponse:
        if not request.path:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                "path is required (a folder of *.safetensors files)")
        version = await self._version(request, context)
        results, served = await self._weights(context, self._sync.update_from_disk(
            request.path, version))
        return admin_pb2.UpdateWeightsFromDiskResponse(ok=all_ok(results), results=results,
                                                       weight_version=served)

    async def InitWeightTransfer(  # noqa: N802 (gRPC method name)
        self, request: admin_pb2.InitWeightTransferRequest, context: grpc.aio.ServicerContext
    ) -> admin_pb2.InitWeightTransferResponse:
        results = await self._weights(context, self._sync.init_transfer(
            request.master_address, request.master_port, request.rank_offset,
            request.world_size, request.timeout_s if request.HasField("timeout_s") else None))
        return admin_pb2.InitWeightTransferResponse(ok=all_ok(results), results=results)

    async def StartWeightUpdate(  # noqa: N802 (gRPC method name)
        self, request: admin_pb2.StartWeightUpdateRequest, context: grpc.aio.ServicerContext
    ) -> admin_pb2.StartWeightUpdateResponse:
        results = await self._weights(context, self._sync.start())
        return admin_pb2.StartWeightUpdateResponse(ok=all_ok(results), results=results)

    async def UpdateWeights(  # noqa: N802 (gRPC method name)
        self, request: admin_pb2.UpdateWeightsRequest, context: grpc.aio.ServicerContext
    ) -> admin_pb2.UpdateWeightsResponse:
        args: dict[str, Any] = {
            "source": "shared_memory" if request.shared_memory_path else "broadcast",
            "names": list(request.names), "dtype_names": list(request.dtype_names),
            "shapes": [list(s.dims) for s in request.shapes]}
        if request.shared_memory_path:
            args.update(path=request.shared_memory_path, offsets=list(request.offsets))
        results = await self._weights(context, self._sync.stage(args))
        return admin_pb2.UpdateWeightsResponse(ok=all_ok(results), results=results)

    async def FinishWeightUpdate(  # noqa: N802 (gRPC method name)
        self, request: admin_pb2.FinishWeightUpdateRequest, context: grpc.aio.ServicerContext
    ) -> admin_pb2.FinishWeightUpdateResponse:
        version = await self._version(request, context)
        results, served = await self._weights(context, self._sync.finish(version))
        return admin_pb2.FinishWeightUpdateResponse(ok=all_ok(results), results=results,
                                                    weight_version=served)

    async def AbortWeightUpdate(  # noqa: N802 (gRPC method name)
        self, request: admin_pb2.AbortWeightUpdateRequest, context: grpc.aio.ServicerContext
    ) -> admin_pb2.AbortWeightUpdateResponse:
        return admin_pb2.AbortWeightUpdateResponse(
            results=await self._weights(context, self._sync.abort()))

    async def GetWeightInfo(  # noqa: N802 (gRPC method name)
        self, request: admin_pb2.GetWeightInfoRequest, context: grpc.aio.ServicerContext
    ) -> admin_pb2.GetWeightInfoResponse:
        return admin_pb2.GetWeightInfoResponse(
            results=await self._call_all(request, context, "weights_info", {}))

    # ---- sleep ----------------------------------------------------------------------

    async def Sleep(  # noqa: N802 (gRPC method name)
        self, request: admin_pb2.SleepRequest, context: grpc.aio.ServicerContext
    ) -> admin_pb2.SleepResponse:
        results = await self._weights(context, self._sync.sleep(
            request.level if request.HasField("level") else 1, _engine_index(request)))
        return admin_pb2.SleepResponse(ok=all_ok(results), results=results)

    async def WakeUp(  # noqa: N802 (gRPC method name)
        self, request: admin_pb2.WakeUpRequest, context: grpc.aio.ServicerContext
    ) -> admin_pb2.WakeUpResponse:
        results = await self._weights(context, self._sync.wake_up(
            list(request.tags), _engine_index(request)))
        return admin_pb2.WakeUpResponse(ok=all_ok(results), results=results)

    async def IsSleeping(  # noqa: N802 (gRPC method name)
        self, request: admin_pb2.IsSleepingRequest, context: grpc.aio.ServicerContext
    ) -> admin_pb2.IsSleepingResponse:
        results = await self._weights(context, self._sync.sleep_info(_engine_index(request)))
        return admin_pb2.IsSleepingResponse(
            results=results,
            is_sleeping=all_ok(results) and all(result_json(r)["is_sleeping"]
                                                for r in results))

    async def GetFaultStatus(  # noqa: N802 (gRPC method name)
        self, request: admin_pb2.GetFaultStatusRequest, context: grpc.aio.ServicerContext
    ) -> admin_pb2.GetFaultStatusResponse:
        return admin_pb2.GetFaultStatusResponse(
            results=await self._call_all(request, context, "fault_status", {}))

    async def RecoverFault(  # noqa: N802 (gRPC method name)
        self, request: admin_pb2.RecoverFaultRequest, context: grpc.aio.ServicerContext
    ) -> admin_pb2.RecoverFaultResponse:
        return admin_pb2.RecoverFaultResponse(
            results=await self._call_all(request, context, "fault_recover", {}))

    async def AbortFault(  # noqa: N802 (gRPC method name)
        self, request: admin_pb2.AbortFaultRequest, context: grpc.aio.ServicerContext
    ) -> admin_pb2.AbortFaultResponse:
        return admin_pb2.AbortFaultResponse(
            results=await self._call_all(request, context, "fault_abort", {}))

    async def _weights(self, context: grpc.aio.ServicerContext, work: Awaitable[T]) -> T:
        try:
            return await work
        except RequestError as e:
            await context.abort(e.code, e.message)
            raise  # not reached: abort raises

    @staticmethod
    async def _version(request: _VersionCarrier, context: grpc.aio.ServicerContext
                       ) -> str | None:
        if not request.HasField("weight_version"):
            return None
        try:
            check_weight_version(request.weight_version, "weight_version")
        except ValueError as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        return request.weight_version

    async def _call_all(self, request: _EngineFilter, context: grpc.aio.ServicerContext,
                        method: str, args: dict[str, Any], timeout_s: float | None = None
                        ) -> list[admin_pb2.EngineResult]:
        engine_index = request.engine_index if request.HasField("engine_index") else None
        try:
            clients = self._sync.clients(engine_index)
        except RequestError as e:
            await context.abort(e.code, e.message)
        return await self._sync.call(clients, method, args, timeout_s or self._timeout_s)


def _engine_index(request: _EngineFilter) -> int | None:
    return request.engine_index if request.HasField("engine_index") else None


def _given_up_result(part: PartStatus) -> admin_pb2.EngineResult:
    return admin_pb2.EngineResult(
        engine_index=int(part.part.removeprefix("engine-")),
        code=grpc.StatusCode.UNAVAILABLE.value[0],
        message=f"corestream serve gave up on {part.part} after {part.restarts} restart(s) "
                f"(a crash loop; last exit {part.last_exit}); the cluster serves without it")
