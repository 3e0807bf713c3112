"""The frontend's one request path, which every door (GenerateService, ChatService and
the HTTP API) walks in the same order:

1. `request()`: the request's telemetry (span, metrics) and time limit, around all
   that follows; the time limit ends the request with DEADLINE_EXCEEDED.
2. Admission and validation: `check_accepting` (refused while the frontend drains),
   `check_sampling`, the prompt checks.
3. Encoding: `encode`, off the event loop for long texts.
4. `prepared()`: the output constraint compile-checked, the length limits applied,
   the trace headers attached.
5. `run()`: routed to an engine and run there (generate/runner.py), chunk by chunk.

A Generate request walks it in `generate()`. A chat request walks it from
chat/answering.py, which renders the conversation between steps 2 and 4; nothing
here calls back into the chat code.

The draining flag lives here, once: the servicers, the HTTP API's /health and the
server's readiness all read it.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
from collections.abc import AsyncIterator, Mapping

import grpc
from corestream.common.v1 import common_pb2
from corestream.generate.v1 import generate_service_pb2 as generate_pb2

from services.common.constraints import OutputConstraint
from services.common.model_info import ModelInfo
from services.common.observability import Observability
from services.common.pooling import Pooler
from services.common.sampling import SamplingParams
from services.frontend.config import FrontendConfig
from services.frontend.errors import RequestError, invalid_argument
from services.frontend.generate.constraint_check import Accepted, ConstraintChecker
from services.frontend.generate.runner import PreparedRequest, RequestRunner
from services.frontend.generate.telemetry import FrontendMetrics, RequestTelemetry
from services.frontend.generate.validation import (
    RequestLimits,
    check_length,
    check_prompt_text,
    check_prompt_token_ids,
    check_sampling,
)
from services.frontend.grpc_calls import MAX_REQUEST_ID_CHARS
from services.frontend.pooling.runner import PoolingRunner
from services.frontend.routing.balancer import Balancer
from services.frontend.tokenizer import TextTokenizer

# Longer texts are tokenized off the event loop so that they do not stall other streams.
_THREADED_TOKENIZE_CHARS = 4096

GenerateRequestLike = generate_pb2.GenerateRequest | generate_pb2.GenerateStreamRequest


class Pipeline:
    def __init__(self, config: FrontendConfig, tokenizer: TextTokenizer, model: ModelInfo,
                 balancer: Balancer, observability: Observability,
                 pooler: Pooler | None = None) -> None:
        self._config = config
        self._observability = observability
        self._metrics = FrontendMetrics(observability.registry,
                                        config.served_model_name or model.name)
        self._tokenizer = tokenizer
        self._model = model
        self._runner = RequestRunner(tokenizer, model, balancer)
        # A pooling model's engines take pooling calls (pooling/operations.py), which
        # share this path's admission, telemetry and time limit, and nothing else.
        self.pooler = pooler
        self.pooling = PoolingRunner(balancer)
        self._limits = RequestLimits(
            max_n=config.max_n, max_stop_strings=config.max_stop_strings,
            max_stop_string_chars=config.max_stop_string_length,
            max_tokens=config.max_tokens_limit)
        self._constraints = ConstraintChecker(tokenizer, model, config.max_constraint_chars,
                                              config.strict_json_schema)
        self._draining = False

    @property
    def draining(self) -> bool:
        return self._draining

    def drain(self) -> None:
        """Refuse new requests from now on; running ones go on."""
        self._draining = True

    @property
    def num_running(self) -> int:
        return self._runner.num_running + self.pooling.num_running

    def end_running(self, reason: str) -> None:
        """End every running request with UNAVAILABLE (`reason`) and refuse new ones."""
        self._runner.close(reason)
        self.pooling.close(reason)

    def abort(self, request_ids: list[str]) -> list[str]:
        """Abort running requests by the client's ids; the aborted ones."""
        return self._runner.abort(request_ids)

    async def generate(self, request_id: str, request: GenerateRequestLike,
                       metadata: Mapping[str, str]
                       ) -> AsyncIterator[generate_pb2.GenerateStreamResponse]:
        """A Generate request's chunks; RequestError when it fails (any transport)."""
        async with self.request(request_id, metadata) as telemetry:
            prepared = await self._prepare(request_id, request, telemetry)
            async for chunk in self.run(prepared, telemetry):
                yield chunk

    @contextlib.asynccontextmanager
    async def request(self, request_id: str, metadata: Mapping[str, str],
                      operation: str = "text_completion") -> AsyncIterator[RequestTelemetry]:
        """One request's telemetry and time limit, around its preparation and run.
        Failures, the time limit included, are RequestErrors. `metadata` carries the
        client's trace headers; `operation` names the request's span (GenAI operation
        names)."""
        try:
            async with (self._telemetry(request_id, metadata, operation) as telemetry,
                        asyncio.timeout(self._config.request_timeout_s)):
                yield telemetry
        except TimeoutError:
            raise RequestError(grpc.StatusCode.DEADLINE_EXCEEDED,
                               self._timeout_message()) from None

    async def run(self, request: PreparedRequest, telemetry: RequestTelemetry
                  ) -> AsyncIterator[generate_pb2.GenerateStreamResponse]:
        """A prepared request's chunks as the engines produce them."""
        async for chunk in self._runner.run(request, telemetry):
            telemetry.on_chunk(chunk)
            yield chunk

    def count_refused(self, error: RequestError) -> None:
        """A request refused before it reached this path (the HTTP door's own checks of
        its body): counted with the others in requests_rejected."""
        self._metrics.count_rejected(error)

    def _telemetry(self, request_id: str, metadata: Mapping[str, str],
                   operation: str) -> RequestTelemetry:
        return RequestTelemetry(self._observability.tracing, self._metrics, request_id,
                                metadata, operation)

    async def _prepare(
        self, request_id: str, request: GenerateRequestLike, telemetry: RequestTelemetry,
    ) -> PreparedRequest:
        """Validate (cheap checks first), tokenize and apply the length limits."""
        with telemetry.phase("validate"):
            sampling, token_ids = self._validate(request_id, request)
        text = request.text if token_ids is None else None
        with telemetry.phase("tokenize"):
            if token_ids is None:
                token_ids = await self.encode(request.text, add_special_tokens=True)
        return await self.prepared(
            PreparedRequest(
                request_id=request_id,
                prompt_token_ids=token_ids,
                sampling=sampling,
                skip_special_tokens=(request.skip_special_tokens
                                     if request.HasField("skip_special_tokens") else True),
                priority=request.priority,
                cache_salt=request.cache_salt,
                data_parallel_rank=(request.data_parallel_rank
                                    if request.HasField("data_parallel_rank") else None),
            ),
            text, telemetry)

    async def prepared(self, request: PreparedRequest, prompt_text: str | None,
                       telemetry: RequestTelemetry) -> PreparedRequest:
        """A tokenized request checked against the length limits and with its output
        constraint checked, ready to run."""
        self.check_generates()
        sampling = request.sampling
        if sampling.constraint is not None:
            with telemetry.phase("validate"):
                accepted = await self._constraints.check(sampling.constraint)
            # The engines compile what the grammar follows; what it leaves out is
            # checked here once each output is complete.
            sampling = dataclasses.replace(sampling, constraint=accepted.checked.engine)
            request = dataclasses.replace(request, warnings=accepted.checked.notes,
                                          output_check=accepted.output_check)
            self._metrics.count_relaxed(accepted.checked.relaxed)
        max_tokens = check_length(
            len(request.prompt_token_ids),
            sampling.max_tokens,
            self._model.max_model_len,
            self._config.max_prompt_tokens,
            self._config.max_tokens_limit,
        )
        sampling = dataclasses.replace(sampling, max_tokens=max_tokens)
        telemetry.on_prepared(sampling, prompt_text, len(request.prompt_token_ids))
        return dataclasses.replace(request, sampling=sampling,
                                   trace_headers=telemetry.trace_headers())

    async def check_constraint(self, constraint: OutputConstraint, field: str) -> Accepted:
        """Compile-check a constraint that came in as `field` (verdicts are cached, so
        the check in `prepared` is then free)."""
        return await self._constraints.check(constraint, field)

    def check_accepting(self) -> None:
        """UNAVAILABLE while the frontend drains."""
        if self._draining:
            raise RequestError(
                grpc.StatusCode.UNAVAILABLE,
                "the frontend is draining (shutting down) and accepts no new requests; "
                "retry on another replica",
                reason="DRAINING",
            )

    def check_generates(self) -> None:
        """FAILED_PRECONDITION on a pooling model, naming what it serves instead."""
        if self.pooler is not None:
            raise RequestError(grpc.StatusCode.FAILED_PRECONDITION, (
                f"this model serves {' and '.join(self.pooler.tasks)}, not generation: "
                "call PoolingService (or /v1/embeddings, /v1/score, /v1/rerank, /classify)"))

    def check_sampling(self, sampling: common_pb2.SamplingParams) -> SamplingParams:
        return check_sampling(sampling, self._model.vocab_size, self._limits)

    def _validate(
        self, request_id: str, request: GenerateRequestLike
    ) -> tuple[SamplingParams, list[int] | None]:
        """The checks that need no tokenizer; the prompt's ids when it came as ids."""
        self.check_accepting()
        if len(request_id) > MAX_REQUEST_ID_CHARS:
            raise invalid_argument(
                "request_id",
                f"request_id has {len(request_id)} characters, "
                f"at most {MAX_REQUEST_ID_CHARS} are allowed",
            )
        sampling = self.check_sampling(request.sampling)
        if request.WhichOneof("prompt") == "token_ids":
            token_ids = list(request.token_ids.ids)
            check_prompt_token_ids(token_ids, self._model.vocab_size)
            return sampling, token_ids
        check_prompt_text(request.text)
        return sampling, None

    async def encode(self, text: str, add_special_tokens: bool) -> list[int]:
        if len(text) > _THREADED_TOKENIZE_CHARS:
            return await asyncio.to_thread(self._tokenizer.encode, text, add_special_tokens)
        return self._tokenizer.encode(text, add_special_tokens)

    def _timeout_message(self) -> str:
        limit = self._config.request_timeout_s
        return f"the request ran longer than the server's limit of {limit:g} s"
