"""Runs one pooling call's inputs on the pooling engines and gathers their results.

Each input is an engine request of its own, `{request_id}-{i}`, routed on its own (the
inputs of one call spread over the engines and find their cached prefixes), and ends
with its pooled values. An engine that dies, or whose Session breaks, before it
answered some inputs hands them to another engine, up to MAX_REROUTES times per call:
a pooled input has no partial output a client could have seen. A call that ends early
(cancelled, timed out, failed) aborts what is still running.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import grpc
import numpy as np
from corestream.common.v1 import common_pb2
from corestream.engine.v1 import engine_core_service_pb2 as engine_pb2

from services.common.pooling import PoolingParams, PoolingTask, PoolingType
from services.frontend.errors import RequestError, engine_error
from services.frontend.routing.balancer import Balancer
from services.frontend.routing.engine_client import EngineClient, EngineEvent, EngineFailure

MAX_REROUTES = 2

_TASKS = {PoolingTask.EMBED: engine_pb2.PoolingParams.TASK_EMBED,
          PoolingTask.CLASSIFY: engine_pb2.PoolingParams.TASK_CLASSIFY}
_TYPES = {PoolingType.LAST: engine_pb2.PoolingParams.POOLING_TYPE_LAST,
          PoolingType.MEAN: engine_pb2.PoolingParams.POOLING_TYPE_MEAN,
          PoolingType.CLS: engine_pb2.PoolingParams.POOLING_TYPE_CLS,
          PoolingType.ALL: engine_pb2.PoolingParams.POOLING_TYPE_ALL}


@dataclass(frozen=True)
class PoolingCall:
    """A validated, tokenized pooling call."""

    request_id: str
    inputs: Sequence[Sequence[int]]
    params: PoolingParams
    arrival_time: float = field(default_factory=time.time)
    trace_headers: Mapping[str, str] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class Pooled:
    """One input's result."""

    values: np.ndarray
    """float32, one dimension (or rows x columns for ALL pooling)."""
    num_tokens: int
    num_cached_tokens: int
    weight_version: str


class _Engine:
    """The inputs of a call sent to one engine, and the task that forwards its events."""

    def __init__(self, client: EngineClient, merged: asyncio.Queue[tuple[_Engine, EngineEvent]]
                 ) -> None:
        self.client = client
        self.events: asyncio.Queue[EngineEvent] = asyncio.Queue()
        self.pending: dict[str, int] = {}
        """Engine request id -> input index, of the inputs it has yet to answer."""
        self._forward = asyncio.get_running_loop().create_task(self._relay(merged))

    async def _relay(self, merged: asyncio.Queue[tuple[_Engine, EngineEvent]]) -> None:
        while True:
            merged.put_nowait((self, await self.events.get()))

    def close(self, abort: bool) -> None:
        self._forward.cancel()
        if abort:
            for request_id in self.pending:
                self.client.abort(request_id)


class PoolingRunner:
    def __init__(self, balancer: Balancer) -> None:
        self._balancer = balancer
        self._running: dict[str, list[_Engine]] = {}
        self._closed_reason = ""

    @property
    def num_running(self) -> int:
        return len(self._running)

    def close(self, reason: str) -> None:
        """End every running call with UNAVAILABLE (`reason`) and refuse new ones."""
        self._closed_reason = reason
        for engines in self._running.values():
            for engine in engines:
                engine.events.put_nowait(EngineFailure(grpc.StatusCode.UNAVAILABLE, reason))

    async def run(self, call: PoolingCall) -> list[Pooled]:
        """Every input's result, in input order; RequestError when the call fails."""
        if self._closed_reason:
            raise RequestError(grpc.StatusCode.UNAVAILABLE, self._closed_reason)
        if call.request_id in self._running:
            raise RequestError(grpc.StatusCode.ALREADY_EXISTS,
                               f"request_id {call.request_id!r} is already running; use a "
                               "unique id", field="request_id")
        merged: asyncio.Queue[tuple[_Engine, EngineEvent]] = asyncio.Queue()
        engines: list[_Engine] = []
        self._running[call.request_id] = engines
        results: list[Pooled | None] = [None] * len(call.inputs)
        lost: list[str] = []
        try:
            self._send(call, range(len(call.inputs)), engines, merged, lost)
            left = len(call.inputs)
            while left:
                engine, event = await merged.get()
                if isinstance(event, EngineFailure):
                    if not (event.engine_lost and len(lost) < MAX_REROUTES):
                        raise RequestError(event.code, event.message)
                    lost.append(engine.client.address)
                    again, engine.pending = list(engine.pending.values()), {}
                    self._send(call, again, engines, merged, lost)
                    continue
                index = engine.pending.pop(event.request_id, None)
                if index is None:
                    continue  # an answer from before a reroute
                results[index] = _pooled(event, len(call.inputs[index]))
                left -= 1
        finally:
            del self._running[call.request_id]
            for engine in engines:
                engine.close(abort=bool(engine.pending))
        return [r for r in results if r is not None]

    def _send(self, call: PoolingCall, indices: Sequence[int], engines: list[_Engine],
              merged: asyncio.Queue[tuple[_Engine, EngineEvent]], lost: list[str]) -> None:
        by_client = {id(e.client): e for e in engines}
        for index in indices:
            token_ids = call.inputs[index]
            route = self._balancer.route(None, token_ids, "", exclude=lost)
            engine = by_client.get(id(route.client))
            if engine is None:
                engine = _Engine(route.client, merged)
                engines.append(engine)
                by_client[id(route.client)] = engine
            request_id = f"{call.request_id}-{index}"
            if lost:
                request_id += f"-r{len(lost)}"  # the lost engine may still know the old id
            engine.pending[request_id] = index
            engine.client.add(_add_request(call, request_id, token_ids), engine.events)


def _add_request(call: PoolingCall, request_id: str, token_ids: Sequence[int]
                 ) -> engine_pb2.AddRequest:
    params = call.params
    pooling = engine_pb2.PoolingParams(task=_TASKS[params.task])
    if params.pooling_type is not None:
        pooling.pooling_type = _TYPES[params.pooling_type]
    if params.normalize is not None:
        pooling.normalize = params.normalize
    if params.dimensions is not None:
        pooling.dimensions = params.dimensions
    if params.activation is not None:
        pooling.activation = params.activation
    return engine_pb2.AddRequest(
        request_id=request_id, prompt_token_ids=token_ids, arrival_time=call.arrival_time,
        trace_headers=dict(call.trace_headers), pooling=pooling)


def _pooled(output: engine_pb2.RequestOutput, num_tokens: int) -> Pooled:
    if output.finish_reason == common_pb2.FINISH_REASON_ERROR:
        raise engine_error(output.error_code, output.error_message)
    if output.finish_reason == common_pb2.FINISH_REASON_ABORT or not output.pooled_shape:
        raise RequestError(grpc.StatusCode.ABORTED,
                           "the request was aborted before its input was pooled")
    values = np.frombuffer(output.pooled, dtype="<f4").reshape(tuple(output.pooled_shape))
    return Pooled(values, num_tokens, output.num_cached_tokens, output.weight_version)
