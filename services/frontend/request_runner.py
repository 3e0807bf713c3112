"""Runs one generation request on an engine and turns its outputs into chunks.

The runner owns the registry of running request ids (for ALREADY_EXISTS and the
Abort RPC). Whatever way a request ends early (client cancel, deadline, failure,
stop string) the engine is told to abort it, so it stops spending compute.
"""

from __future__ import annotations

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
from services.frontend.balancer import Balancer
from services.frontend.detokenizer import IncrementalDetokenizer, StopStringMatcher
from services.frontend.engine_client import EngineClient, EngineFailure
from services.frontend.errors import RequestError, status_code_from_int
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
    arrival_time: float = field(default_factory=time.time)
    trace_headers: Mapping[str, str] = field(default_factory=dict)


class RequestRunner:
    def __init__(self, tokenizer: TextTokenizer, model: ModelInfo, balancer: Balancer) -> None:
        self._tokenizer = tokenizer
        self._model = model
        self._balancer = balancer
        self._running: dict[str, EngineClient] = {}

    def abort(self, request_ids: list[str]) -> list[str]:
        """Abort running requests; their streams end with FINISH_REASON_ABORT."""
        aborted = []
        for request_id in request_ids:
            client = self._running.get(request_id)
            if client is not None and client.abort(request_id, notify=True):
                aborted.append(request_id)
        return aborted

    async def run(
        self, request: PreparedRequest
    ) -> AsyncIterator[generate_pb2.GenerateStreamResponse]:
        request_id = request.request_id
        if request_id in self._running:
            raise RequestError(
                grpc.StatusCode.ALREADY_EXISTS,
                f"request_id {request_id!r} is already running; use a unique id",
                field="request_id",
            )
        client = self._balancer.pick()
        queue = client.add(self._add_request(request))
        self._running[request_id] = client
        finished = False
        try:
            detokenizer = IncrementalDetokenizer(
                self._tokenizer, request.prompt_token_ids, request.skip_special_tokens
            )
            matcher = StopStringMatcher(
                request.sampling.stop, request.sampling.include_stop_str_in_output
            )
            num_generated = 0
            num_cached = 0
            while True:
                event = await queue.get()
                output = _raise_on_failure(event)
                token_ids = list(output.new_token_ids)
                num_generated += len(token_ids)
                num_cached = max(num_cached, output.num_cached_tokens)
                text, stop = matcher.feed(
                    detokenizer.push(token_ids),
                    check=num_generated >= request.sampling.min_tokens,
                )
                chunk = generate_pb2.GenerateStreamResponse(
                    request_id=request_id, text=text, token_ids=token_ids
                )
                if stop is not None:
                    # The engine does not see text; stop it here.
                    client.abort(request_id)
                    chunk.finish_reason = common_pb2.FINISH_REASON_STOP_STRING
                    chunk.stop_string = stop
                elif output.finish_reason != common_pb2.FINISH_REASON_UNSPECIFIED:
                    chunk.text += matcher.flush()
                    chunk.finish_reason = output.finish_reason
                    if output.HasField("stop_token_id"):
                        chunk.stop_token_id = output.stop_token_id
                else:
                    if token_ids or text:
                        yield chunk
                    continue
                finished = True
                chunk.usage.CopyFrom(
                    common_pb2.Usage(
                        prompt_tokens=len(request.prompt_token_ids),
                        completion_tokens=num_generated,
                        cached_tokens=num_cached,
                    )
                )
                yield chunk
                return
        finally:
            self._running.pop(request_id, None)
            if not finished:
                # Cancelled, timed out or failed: free the engine's slot.
                client.abort(request_id)

    def _add_request(self, request: PreparedRequest) -> engine_pb2.AddRequest:
        return engine_pb2.AddRequest(
            request_id=request.request_id,
            prompt_token_ids=request.prompt_token_ids,
            sampling=sampling_to_proto(request.sampling),
            arrival_time=request.arrival_time,
            priority=request.priority,
            cache_salt=request.cache_salt,
            trace_headers=dict(request.trace_headers),
            eos_token_ids=self._model.eos_token_ids,
        )


def _raise_on_failure(event: engine_pb2.RequestOutput | EngineFailure) -> engine_pb2.RequestOutput:
    if isinstance(event, EngineFailure):
        raise RequestError(event.code, event.message)
    if event.finish_reason == common_pb2.FINISH_REASON_ERROR:
        code = status_code_from_int(event.error_code) if event.error_code else None
        raise RequestError(
            code or grpc.StatusCode.INTERNAL,
            event.error_message or "the engine failed the request",
        )
    return event
