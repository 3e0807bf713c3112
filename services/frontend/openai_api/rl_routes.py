"""vLLM's routes for RL trainers on the HTTP door: pause and resume generation, and
live weight updates, so that a trainer written against vLLM (TRL, verl, OpenRLHF)
drives corestream unchanged.

    POST /pause?mode=abort|wait|keep      GET /is_paused       POST /resume
         &clear_cache=true|false          (as vLLM: default true, the prefix cache goes)
         &timeout_s=600                   ours: mode wait answers once nothing runs;
                                           this bounds that wait
    POST /init_weight_transfer_engine     {"init_info": {master_address, master_port,
                                           rank_offset, world_size}}
    POST /start_weight_update             {"is_checkpoint_format": bool} (ignored: names
                                           are always the checkpoint's)
    POST /update_weights                  {"update_info": {names, dtype_names, shapes}};
                                           ours: "shared_memory_path" + "offsets" read a
                                           file instead of broadcasts
    POST /finish_weight_update            ours: {"weight_version": "..."} (optional)
    POST /abort_weight_update             ours
    POST /update_weights_from_disk        SGLang's: {"model_path", "weight_version"}
    GET  /weight_info                     ours: {"weight_version", "engines": [...]}
    POST /sleep?level=1|2                 GET /is_sleeping
    POST /wake_up?tags=weights&tags=kv_cache   (no tags: both)

Each reaches every engine through `WeightSync` (an update is atomic across them). They
need an admin key when the frontend has any (else an API key when it has those), as
the gRPC AdminService does. A call that fails on any engine answers with the first
failure's status and every engine's message; the engines keep serving on the old
weights.
"""

from __future__ import annotations

import math
from collections.abc import Awaitable, Callable
from typing import Any

import grpc
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from services.common.weight_version import check_weight_version
from services.frontend.errors import RequestError, invalid_argument
from services.frontend.openai_api.http_errors import error_response
from services.frontend.openai_api.json_body import parse_json, read_body
from services.frontend.weight_sync import (
    PAUSE_WAIT_TIMEOUT_S,
    Results,
    WeightSync,
    all_ok,
    result_json,
)

PAUSE_MODES = ("abort", "wait", "keep")
# Weight names and shapes of a whole model fit; fixed, as trainers send what they must.
MAX_BODY_BYTES = 64 << 20

Handler = Callable[[Request], Awaitable[dict[str, Any]]]


class RlRoutes:
    def __init__(self, sync: WeightSync, authenticate: Callable[[Request], None],
                 body_timeout_s: float) -> None:
        self._sync = sync
        self._authenticate = authenticate
        self._body_timeout_s = body_timeout_s

    def routes(self) -> list[Route]:
        return [Route(path, self._wrap(handler), methods=[method]) for path, method, handler in (
            ("/pause", "POST", self.pause),
            ("/resume", "POST", self.resume),
            ("/is_paused", "GET", self.is_paused),
            ("/init_weight_transfer_engine", "POST", self.init_weight_transfer_engine),
            ("/start_weight_update", "POST", self.start_weight_update),
            ("/update_weights", "POST", self.update_weights),
            ("/finish_weight_update", "POST", self.finish_weight_update),
            ("/abort_weight_update", "POST", self.abort_weight_update),
            ("/update_weights_from_disk", "POST", self.update_weights_from_disk),
            ("/weight_info", "GET", self.weight_info),
            ("/sleep", "POST", self.sleep),
            ("/wake_up", "POST", self.wake_up),
            ("/is_sleeping", "GET", self.is_sleeping),
        )]

    def _wrap(self, handler: Handler) -> Callable[[Request], Awaitable[Response]]:
        async def endpoint(request: Request) -> Response:
            try:
                self._authenticate(request)
                return JSONResponse(await handler(request))
            except RequestError as e:
                return error_response(e)
        return endpoint

    async def pause(self, request: Request) -> dict[str, Any]:
        mode = request.query_params.get("mode", "abort")
        if mode not in PAUSE_MODES:
            raise invalid_argument("mode", f"mode must be one of {', '.join(PAUSE_MODES)}, "
                                   f"got {mode!r}")
        clear_cache = _query_bool(request, "clear_cache", default=True)
        default_timeout = PAUSE_WAIT_TIMEOUT_S if mode == "wait" else None
        timeout_s = _query_seconds(request, "timeout_s", default_timeout, PAUSE_WAIT_TIMEOUT_S)
        results = _checked(await self._sync.call(
            self._sync.clients(), "pause", {"mode": mode, "clear_cache": clear_cache},
            timeout_s))
        return {"paused": True, "mode": mode, "engines": _engines(results)}

    async def resume(self, request: Request) -> dict[str, Any]:
        results = _checked(await self._sync.call(self._sync.clients(), "resume", {}))
        return {"paused": False, "engines": _engines(results)}

    async def is_paused(self, request: Request) -> dict[str, Any]:
        results = _checked(await self._sync.call(self._sync.clients(), "get_stats", {}))
        return {"is_paused": all(result_json(r).get("paused") for r in results)}

    async def init_weight_transfer_engine(self, request: Request) -> dict[str, Any]:
        info = _object(await self._json(request), "init_info")
        results = _checked(await self._sync.init_transfer(
            _str(info, "init_info.master_address"), _int(info, "init_info.master_port"),
            _int(info, "init_info.rank_offset"), _int(info, "init_info.world_size"),
            _timeout(info, "init_info.timeout_s")))
        return {"message": "Weight transfer initialized", "engines": _engines(results)}

    async def start_weight_update(self, request: Request) -> dict[str, Any]:
        await self._json(request, required=False)
        results = _checked(await self._sync.start())
        return {"message": "Weight update started", "engines": _engines(results)}

    async def update_weights(self, request: Request) -> dict[str, Any]:
        info = _object(await self._json(request), "update_info")
        args: dict[str, Any] = {"source": "broadcast", "names": info.get("names") or [],
                                "dtype_names": info.get("dtype_names") or [],
                                "shapes": info.get("shapes") or []}
        if info.get("shared_memory_path"):
            args.update(source="shared_memory", path=_str(info, "update_info.shared_memory_path"),
                        offsets=info.get("offsets") or [])
        results = _checked(await self._sync.stage(args))
        return {"message": "Weights received", "engines": _engines(results)}

    async def finish_weight_update(self, request: Request) -> dict[str, Any]:
        body = await self._json(request, required=False)
        results, version = await self._sync.finish(_version(body, "weight_version"))
        _checked(results)
        return {"message": "Weight update finished", "weight_version": version,
                "engines": _engines(results)}

    async def abort_weight_update(self, request: Request) -> dict[str, Any]:
        results = _checked(await self._sync.abort())
        return {"message": "Weight update aborted", "engines": _engines(results)}

    async def update_weights_from_disk(self, request: Request) -> dict[str, Any]:
        body = await self._json(request)
        results, version = await self._sync.update_from_disk(
            _str(body, "model_path"), _version(body, "weight_version"))
        _checked(results)
        return {"success": True, "message": "Weights updated", "weight_version": version,
                "engines": _engines(results)}

    async def sleep(self, request: Request) -> dict[str, Any]:
        raw = request.query_params.get("level", "1")
        # Not str.isdigit: it takes digits that int() refuses ("²").
        if raw not in ("1", "2"):
            raise invalid_argument("level", f"level must be 1 or 2, got {raw!r}")
        results = _checked(await self._sync.sleep(int(raw)))
        return {"is_sleeping": True, "level": int(raw), "engines": _engines(results)}

    async def wake_up(self, request: Request) -> dict[str, Any]:
        tags = request.query_params.getlist("tags")
        results = _checked(await self._sync.wake_up(tags))
        return {"is_sleeping": any(result_json(r)["is_sleeping"] for r in results),
                "engines": _engines(results)}

    async def is_sleeping(self, request: Request) -> dict[str, Any]:
        results = _checked(await self._sync.sleep_info())
        return {"is_sleeping": all(result_json(r)["is_sleeping"] for r in results),
                "engines": _engines(results)}

    async def _json(self, request: Request, required: bool = True) -> dict[str, Any]:
        raw = await read_body(request, MAX_BODY_BYTES, self._body_timeout_s,
                              source="the RL routes' fixed limit")
        if not raw.strip():
            if required:
                raise invalid_argument("body", "a JSON object body is required")
            return {}
        body = parse_json(raw)
        if not isinstance(body, dict):
            raise invalid_argument("body", "the request body must be a JSON object")
        return body

    async def weight_info(self, request: Request) -> dict[str, Any]:
        results = _checked(await self._sync.call(self._sync.clients(), "weights_info", {}))
        versions = sorted({result_json(r)["weight_version"] for r in results})
        return {"weight_version": ",".join(versions), "engines": _engines(results)}


def _checked(results: Results) -> Results:
    """`results` when every engine succeeded; else the first failure's RequestError."""
    if all_ok(results):
        return results
    failed = [r for r in results if not r.ok]
    code = next((c for c in grpc.StatusCode if c.value[0] == failed[0].code),
                grpc.StatusCode.INTERNAL)
    raise RequestError(code, "; ".join(f"engine {r.engine_index}: {r.message}" for r in failed))


def _query_bool(request: Request, name: str, default: bool) -> bool:
    raw = request.query_params.get(name)
    if raw is None:
        return default
    if raw.lower() not in ("true", "false", "1", "0"):
        raise invalid_argument(name, f"{name} must be true or false, got {raw!r}")
    return raw.lower() in ("true", "1")


def _query_seconds(request: Request, name: str, default: float | None,
                   limit: float) -> float | None:
    raw = request.query_params.get(name)
    if raw is None:
        return default
    try:
        seconds = float(raw)
    except ValueError:
        seconds = float("nan")
    if not 0 < seconds <= limit:  # also refuses nan
        raise invalid_argument(name, f"{name} must be a number of seconds in (0, {limit:g}], "
                               f"got {raw!r}")
    return seconds


def _engines(results: Results) -> list[dict[str, Any]]:
    return [{"engine_index": r.engine_index, **result_json(r)} for r in results]


def _object(body: dict[str, Any], key: str) -> dict[str, Any]:
    value = body.get(key)
    if not isinstance(value, dict):
        raise invalid_argument(key, f"{key} (an object) is required")
    return value


def _str(body: dict[str, Any], field: str) -> str:
    value = body.get(field.rpartition(".")[2])
    if not isinstance(value, str) or not value:
        raise invalid_argument(field, f"{field} (a string) is required")
    return value


def _int(body: dict[str, Any], field: str) -> int:
    value = body.get(field.rpartition(".")[2])
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise invalid_argument(field, f"{field} must be a non-negative integer, got {value!r}")
    return value


def _timeout(body: dict[str, Any], field: str) -> float | None:
    value = body.get(field.rpartition(".")[2])
    if value is None:
        return None
    # float() of a huge JSON integer overflows (OverflowError): checked as a number first.
    number = isinstance(value, int | float) and not isinstance(value, bool)
    seconds = float(value) if number and abs(value) < 1e300 else math.nan
    if not (seconds > 0 and math.isfinite(seconds)):
        raise invalid_argument(field, f"{field} must be a positive number of seconds, "
                               f"got {value!r}")
    return seconds


def _version(body: dict[str, Any], field: str) -> str | None:
    value = body.get(field)
    if value is None:
        return None
    try:
        check_weight_version(str(value), field)
    except ValueError as e:
        raise invalid_argument(field, str(e)) from None
    return str(value)

