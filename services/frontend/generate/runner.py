"""Runs one generation request on an engine and turns its outputs into chunks.

A request of `sampling.n` samples becomes n engine requests `{request_id}-{i}` on
one engine (n = 1 keeps the plain id), whose chunks are interleaved on the stream
with their `index`. Sample 0 goes first; the others follow once it has produced a
token, so that its prompt blocks are in the engine's prefix cache by then and the
siblings compute only what they sample. Only sample 0 asks for prompt logprobs.

An engine that dies (or whose Session breaks) before the request had any output
fails it with `engine_lost`: nothing reached the client, so the request runs again
on another engine, up to MAX_REROUTES times, instead of failing for a death that
the router had not heard of when it chose. Once a token has arrived it is never
replayed.

The runner owns the registry of running request ids (for ALREADY_EXISTS and the
Abort RPC, which both take the client's id). Whatever way a request ends early
(client cancel, deadline, failure) the engine is told to abort every sample, and a
sample that matches a stop string is aborted on its own, so that the engine stops
spending compute.
"""
from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import time
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass, field

import grpc
from corestream.common.v1 import common_pb2
from corestream.engine.v1 import engine_core_service_pb2 as engine_pb2
from corestream.generate.v1 import generate_service_pb2 as generate_pb2

from services.common.convert import sampling_to_proto
from services.common.model_info import ModelInfo
from services.common.sampling import SamplingParams
from services.frontend.errors import RequestError, engine_error
from services.frontend.generate.constraint_check import OutputCheck
from services.frontend.generate.sample_stream import SampleStream, with_token_text
from services.frontend.generate.telemetry import RequestTelemetry
from services.frontend.routing.balancer import Balancer
from services.frontend.routing.engine_client import EngineClient, EngineEvent, EngineFailure
from services.frontend.tokenizer import TextTokenizer


@dataclass(frozen=True)
class PreparedRequest:
    """A validated, tokenized request, ready for an engine."""

    request_id: str
    prompt_token_ids: list[int]
    sampling: SamplingParams
    skip_special_tokens: bool = True
    priority: int = 0
    cache_salt: str = ""
    data_parallel_rank: int | None = None
    """Run on this engine rank instead of the least loaded one."""
    arrival_time: float = field(default_factory=time.time)
    trace_headers: Mapping[str, str] = field(default_factory=dict)
    warnings: tuple[str, ...] = ()
    """What the grammar does not enforce of the constraint, for the first chunk."""
    output_check: OutputCheck | None = None
    """Validates each sample's output once its constraint is complete."""


log = logging.getLogger(__name__)

_INT64_MASK = (1 << 64) - 1
MAX_REROUTES = 2


class _EngineRequests:
    """The engine requests of one client request: those sent and those still to send."""

    def __init__(
        self,
        client: EngineClient,
        events: asyncio.Queue[EngineEvent],
        adds: list[engine_pb2.AddRequest],
    ) -> None:
        self.client = client
        self.events = events
        self._unsent = adds
        self.sent: list[str] = []

    def send(self, count: int | None = None) -> None:
        """Send the next `count` requests (all when None)."""
        count = len(self._unsent) if count is None else count
        batch, self._unsent = self._unsent[:count], self._unsent[count:]
        for add in batch:
            self.client.add(add, self.events)
            self.sent.append(add.request_id)

    def abort(self, notify: bool = False) -> bool:
        """Abort every sample (none is sent any more); with `notify` each sample's
        stream still ends, with FINISH_REASON_ABORT."""
        aborted = [self.client.abort(rid, notify) for rid in self.sent]
        unsent, self._unsent = self._unsent, []
        if notify:
            for add in unsent:
                self.events.put_nowait(engine_pb2.RequestOutput(
                    request_id=add.request_id, finish_reason=common_pb2.FINISH_REASON_ABORT))
        return any(aborted) or bool(unsent)


class RequestRunner:
    def __init__(self, tokenizer: TextTokenizer, model: ModelInfo, balancer: Balancer) -> None:
        self._tokenizer = tokenizer
        self._model = model
        self._balancer = balancer
        self._running: dict[str, _EngineRequests] = {}
        self._closed_reason = ""

    @property
    def num_running(self) -> int:
        return len(self._running)

    def close(self, reason: str) -> None:
        """End every running request with UNAVAILABLE (`reason`) and refuse new ones."""
        self._closed_reason = reason
        for engine in self._running.values():
            engine.events.put_nowait(EngineFailure(grpc.StatusCode.UNAVAILABLE, reason))

    def abort(self, request_ids: list[str]) -> list[str]:
        """Abort running requests; their streams end with FINISH_REASON_ABORT."""
        return [
            request_id for request_id in request_ids
            if (running := self._running.get(request_id)) is not None
            and running.abort(notify=True)
        ]

    async def run(
        self, request: PreparedRequest, telemetry: RequestTelemetry | None = None
    ) -> AsyncIterator[generate_pb2.GenerateStreamResponse]:
        request_id = request.request_id
        if self._closed_reason:
            raise RequestError(grpc.StatusCode.UNAVAILABLE, self._closed_reason)
        if request_id in self._running:
            raise RequestError(
                grpc.StatusCode.ALREADY_EXISTS,
                f"request_id {request_id!r} is already running; use a unique id",
                field="request_id",
            )
        n = request.sampling.n
        samples = [
            SampleStream(i, _engine_request_id(request_id, i, n), self._tokenizer,
                         request.prompt_token_ids, request.sampling, request.skip_special_tokens,
                         request.output_check)
            for i in range(n)
        ]
        by_engine_id = {s.engine_request_id: s for s in samples}
        with telemetry.phase("route") if telemetry else contextlib.nullcontext():
            route = self._balancer.route(request.data_parallel_rank,
                                         request.prompt_token_ids, request.cache_salt)
            if telemetry:
                telemetry.on_routed(route, self._balancer.policy)
        engine = self._start(request, samples, route.client)
        lost: list[str] = []  # engines that died under this request before any output
        delivered = False
        unfinished = n
        warnings = list(request.warnings)
        try:
            prompt_logprobs: list[common_pb2.PositionLogprobs] = []
            while unfinished:
                event = await engine.events.get()
                if (isinstance(event, EngineFailure) and event.engine_lost and not delivered
                        and len(lost) < MAX_REROUTES):
                    lost.append(engine.client.address)
                    engine = self._reroute(request, samples, lost, event)
                    continue
                output = _raise_on_failure(event)
                delivered = True
                sample = by_engine_id.get(output.request_id)
                if sample is None or sample.finished:
                    continue
                if sample.index == 0 and not sample.num_generated:
                    engine.send()  # sample 0 has computed the prompt: the siblings follow
                started = time.monotonic()
                prompt_logprobs += with_token_text(self._tokenizer, output.prompt_logprobs)
                chunk = sample.on_output(request_id, output)
                if telemetry:
                    telemetry.detokenized(started)
                if chunk is None:
                    continue
                if sample.stopped_by_string:
                    engine.client.abort(sample.engine_request_id)  # the engine sees no text
                if prompt_logprobs:
                    chunk.prompt_logprobs.extend(prompt_logprobs)
                    prompt_logprobs = []
                if warnings:
                    chunk.warnings.extend(warnings)
                    warnings = []
                if sample.finished:
                    unfinished -= 1
                    if not unfinished:
                        chunk.usage.CopyFrom(_usage(request, samples))
                yield chunk
        finally:
            self._running.pop(request_id, None)
            if unfinished:
                # Cancelled, timed out or failed: free the engine's slots.
                engine.abort()

    def _start(self, request: PreparedRequest, samples: list[SampleStream],
               client: EngineClient) -> _EngineRequests:
        engine = _EngineRequests(
            client, asyncio.Queue(),
            [self._add_request(request, s.index, s.engine_request_id) for s in samples],
        )
        engine.send(1)
        self._running[request.request_id] = engine
        return engine

    def _reroute(self, request: PreparedRequest, samples: list[SampleStream],
                 lost: list[str], failure: EngineFailure) -> _EngineRequests:
        """Run the request again on an engine not in `lost`; the failure's error when
        there is none."""
        try:
            route = self._balancer.route(request.data_parallel_rank, request.prompt_token_ids,
                                         request.cache_salt, exclude=lost)
        except RequestError:
            raise RequestError(failure.code, failure.message) from None
        log.warning("request %s: %s before any output; running it on %s instead",
                    request.request_id, failure.message, route.client.name)
        return self._start(request, samples, route.client)

    def _add_request(
        self, request: PreparedRequest, index: int, engine_request_id: str
    ) -> engine_pb2.AddRequest:
        sampling = request.sampling
        seed = sampling.seed
        if seed is not None:
            # seed + index keeps the samples distinct but reproducible; wrapped into int64.
            seed = (seed + index + (1 << 63) & _INT64_MASK) - (1 << 63)
        sampling = dataclasses.replace(
            sampling, n=1, seed=seed,
            prompt_logprobs=sampling.prompt_logprobs if index == 0 else None,
        )
        return engine_pb2.AddRequest(
            request_id=engine_request_id,
            prompt_token_ids=request.prompt_token_ids,
            sampling=sampling_to_proto(sampling),
            arrival_time=request.arrival_time,
            priority=request.priority,
            cache_salt=request.cache_salt,
            trace_headers=dict(request.trace_headers),
            eos_token_ids=self._model.eos_token_ids,
        )


def _engine_request_id(request_id: str, index: int, n: int) -> str:
    return request_id if n == 1 else f"{request_id}-{index}"


def _usage(request: PreparedRequest, samples: list[SampleStream]) -> common_pb2.Usage:
    """The prompt counts once; the samples share it, so the cached part is the most
    any of them found."""
    return common_pb2.Usage(
        prompt_tokens=len(request.prompt_token_ids),
        completion_tokens=sum(s.num_generated for s in samples),
        cached_tokens=max(s.num_cached_tokens for s in samples),
    )


def _raise_on_failure(event: EngineEvent) -> engine_pb2.RequestOutput:
    if isinstance(event, EngineFailure):
        raise RequestError(event.code, event.message)
    if event.finish_reason == common_pb2.FINISH_REASON_ERROR:
        raise engine_error(event.error_code, event.error_message)
    return event
