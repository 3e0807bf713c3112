"""The public GenerateService and the frontend's gRPC server around it (which also
serves AdminService, see admin.py).

Shutdown (SIGTERM) drains: readiness turns NOT_SERVING and new generation calls get
UNAVAILABLE ("draining"); running ones may finish within the shutdown timeout,
then whatever is left ends with UNAVAILABLE ("shutting down") and the server stops.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import logging
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping

import grpc
from corestream.common.v1 import common_pb2
from corestream.generate.v1 import admin_service_pb2_grpc as admin_pb2_grpc
from corestream.generate.v1 import chat_service_pb2_grpc as chat_pb2_grpc
from corestream.generate.v1 import generate_service_pb2 as generate_pb2
from corestream.generate.v1 import generate_service_pb2_grpc as generate_pb2_grpc

from services.common.auth import BearerAuthInterceptor, load_keys
from services.common.constraints import OutputConstraint
from services.common.grpc_server import (
    AioHealth,
    add_aio_health_and_reflection,
    bind,
    host_port,
    server_options,
    start_aio_health_port,
)
from services.common.malformed import RejectMalformedInterceptor
from services.common.model_info import ModelInfo
from services.common.observability import Observability
from services.common.observability_config import ObservabilityConfig
from services.common.restart_status import given_up_engines
from services.common.sampling import SamplingParams
from services.common.security_config import PLAINTEXT, SecurityConfig
from services.frontend import admin, chat_service
from services.frontend.balancer import Balancer
from services.frontend.chat_service import ChatServicer
from services.frontend.chat_template import ChatTemplates
from services.frontend.config import FrontendConfig
from services.frontend.constraint_check import Accepted, ConstraintChecker
from services.frontend.engine_client import EngineClient
from services.frontend.errors import RequestError, invalid_argument, to_status
from services.frontend.grpc_calls import (
    MAX_REQUEST_ID_CHARS,
    aborting_on_error,
    call_metadata,
    start_call,
)
from services.frontend.load_watcher import LoadWatcher
from services.frontend.openai_api.app import HttpServer, HttpSettings, OpenAIApi
from services.frontend.prefix_index import PrefixIndex
from services.frontend.request_runner import PreparedRequest, RequestRunner, collect_generate
from services.frontend.request_telemetry import FrontendMetrics, RequestTelemetry
from services.frontend.routing import RoutingPolicy
from services.frontend.tokenizer import TextTokenizer
from services.frontend.validation import (
    RequestLimits,
    check_length,
    check_prompt_text,
    check_prompt_token_ids,
    check_sampling,
)

log = logging.getLogger(__name__)

SERVICE_NAME = generate_pb2.DESCRIPTOR.services_by_name["GenerateService"].full_name
# Longer texts are tokenized off the event loop so that they do not stall other streams.
_THREADED_TOKENIZE_CHARS = 4096
# After the drain, how long the aborted streams get to send their status.
_FINAL_GRACE_S = 2.0

GenerateRequestLike = generate_pb2.GenerateRequest | generate_pb2.GenerateStreamRequest


class GenerateServicer(generate_pb2_grpc.GenerateServiceServicer):
    def __init__(
        self,
        config: FrontendConfig,
        tokenizer: TextTokenizer,
        model: ModelInfo,
        balancer: Balancer,
        observability: Observability | None = None,
    ) -> None:
        self._config = config
        self._observability = observability or Observability(
            "frontend", ObservabilityConfig(), config.host)
        self._metrics = FrontendMetrics(self._observability.registry,
                                        config.served_model_name or model.name)
        self._tokenizer = tokenizer
        self._model = model
        self._balancer = balancer
        self._runner = RequestRunner(tokenizer, model, balancer)
        self._limits = RequestLimits(
            max_n=config.max_n, max_stop_strings=config.max_stop_strings,
            max_stop_string_chars=config.max_stop_string_length,
            max_tokens=config.max_tokens_limit)
        self._constraints = ConstraintChecker(tokenizer, model, config.max_constraint_chars,
                                              config.strict_json_schema)
        self.draining = False

    @property
    def num_running(self) -> int:
        return self._runner.num_running

    def end_running(self, reason: str) -> None:
        self._runner.close(reason)

    async def GenerateStream(
        self, request: generate_pb2.GenerateStreamRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[generate_pb2.GenerateStreamResponse]:
        request_id = await start_call(request.request_id, context)
        async for chunk in aborting_on_error(
                self.generate(request_id, request, call_metadata(context)), context):
            yield chunk

    async def Generate(
        self, request: generate_pb2.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> generate_pb2.GenerateResponse:
        request_id = await start_call(request.request_id, context)
        chunks = self.generate(request_id, request, call_metadata(context))
        return await collect_generate(request_id, aborting_on_error(chunks, context))

    async def Tokenize(
        self, request: generate_pb2.TokenizeRequest, context: grpc.aio.ServicerContext
    ) -> generate_pb2.TokenizeResponse:
        add_special = request.add_special_tokens if request.HasField("add_special_tokens") else True
        token_ids = await self.encode(request.text, add_special)
        return generate_pb2.TokenizeResponse(
            token_ids=token_ids, tokens=self._tokenizer.token_strings(token_ids)
        )

    async def Detokenize(
        self, request: generate_pb2.DetokenizeRequest, context: grpc.aio.ServicerContext
    ) -> generate_pb2.DetokenizeResponse:
        skip = request.skip_special_tokens if request.HasField("skip_special_tokens") else True
        for i, token_id in enumerate(request.token_ids):
            if token_id >= self._tokenizer.vocab_size:
                error = invalid_argument(
                    "token_ids",
                    f"token_ids[{i}] = {token_id} is out of the tokenizer's vocabulary "
                    f"(token ids must be < {self._tokenizer.vocab_size})",
                )
                await context.abort_with_status(to_status(error))
        text = self._tokenizer.decode(list(request.token_ids), skip_special_tokens=skip)
        return generate_pb2.DetokenizeResponse(text=text)

    async def GetModelInfo(
        self, request: generate_pb2.GetModelInfoRequest, context: grpc.aio.ServicerContext
    ) -> generate_pb2.GetModelInfoResponse:
        model = self._model
        response = generate_pb2.GetModelInfoResponse(
            model=self._config.served_model_name or model.name,
            architectures=model.architectures,
            max_context_length=model.max_model_len,
            vocab_size=model.vocab_size,
            eos_token_ids=model.eos_token_ids,
            dtype=model.dtype,
            num_engines=self._balancer.num_connected,
            degraded=self._balancer.degraded,
            tensor_parallel_size=self._balancer.tensor_parallel_size,
            engines_given_up=given_up_engines(self._config.restart_status_file),
        )
        if model.bos_token_id is not None:
            response.bos_token_id = model.bos_token_id
        return response

    async def Abort(
        self, request: generate_pb2.AbortRequest, context: grpc.aio.ServicerContext
    ) -> generate_pb2.AbortResponse:
        aborted = self._runner.abort(list(request.request_ids))
        if aborted:
            log.info("aborted %d request(s) on request", len(aborted))
        return generate_pb2.AbortResponse(aborted_request_ids=aborted)

    def generate(self, request_id: str, request: GenerateRequestLike,
                 metadata: Mapping[str, str]) -> AsyncIterator[generate_pb2.GenerateStreamResponse]:
        """A Generate request's chunks; RequestError when it fails (any transport)."""
        return self.run(request_id, metadata,
                        functools.partial(self._prepare, request_id, request))

    async def run(
        self, request_id: str, metadata: Mapping[str, str],
        prepare: Callable[[RequestTelemetry], Awaitable[PreparedRequest]],
        operation: str = "text_completion",
    ) -> AsyncIterator[generate_pb2.GenerateStreamResponse]:
        """One request's chunks as the engines produce them, for every generating call
        (ChatService's and the HTTP API's too): `prepare` validates and tokenizes under
        the request's telemetry and time limit. Failures, the time limit included, are
        RequestErrors. `metadata` carries the client's trace headers; `operation` names
        the request's span (GenAI operation names)."""
        try:
            async with (self._telemetry(request_id, metadata, operation) as telemetry,
                        asyncio.timeout(self._config.request_timeout_s)):
                prepared = await prepare(telemetry)
                async for chunk in self._runner.run(prepared, telemetry):
                    telemetry.on_chunk(chunk)
                    yield chunk
        except TimeoutError:
            raise RequestError(grpc.StatusCode.DEADLINE_EXCEEDED,
                               self._timeout_message()) from None

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
        if self.draining:
            raise RequestError(
                grpc.StatusCode.UNAVAILABLE,
                "the frontend is draining (shutting down) and accepts no new requests; "
                "retry on another replica",
                reason="DRAINING",
            )

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


class FrontendServer:
    """GenerateService, ChatService and AdminService plus health and reflection, fed by
    a coordinator or static engines."""

    def __init__(self, config: FrontendConfig, tokenizer: TextTokenizer, model: ModelInfo,
                 security: SecurityConfig = PLAINTEXT,
                 observability: Observability | None = None,
                 chat_templates: ChatTemplates | None = None) -> None:
        self._config = config
        self.observability = observability or Observability(
            "frontend", ObservabilityConfig(), config.host)
        self._security = security
        self._health_server: grpc.aio.Server | None = None
        self._frontend_id = f"frontend-{uuid.uuid4().hex[:12]}"
        policy = RoutingPolicy(config.routing_policy)
        self.balancer = Balancer(
            self._frontend_id, on_readiness=self._on_readiness,
            client_factory=functools.partial(EngineClient,
                                             watchdog_timeout_s=config.watchdog_timeout,
                                             security=security),
            policy=policy,
            prefix_index=PrefixIndex(config.prefix_index_max_blocks)
            if policy is RoutingPolicy.CACHE_AWARE else None,
            prefill_tokens_per_request=config.prefill_tokens_per_request,
        )
        self._model = model
        self._servicer = GenerateServicer(config, tokenizer, model, self.balancer,
                                          self.observability)
        self._chat = ChatServicer(config, self._servicer, tokenizer,
                                  chat_templates or ChatTemplates(default=None),
                                  model.eos_token_ids)
        self._server: grpc.aio.Server | None = None
        self._http: HttpServer | None = None
        self.http_port = -1
        self.http_scheme = "http"
        self._health: AioHealth | None = None
        self._watcher: LoadWatcher | None = None
        self._health_lock = asyncio.Lock()
        self._draining = False
        self._background: set[asyncio.Task[None]] = set()
        self.port = 0

    async def start(self) -> int:
        """Serve and start following engines; returns the bound port."""
        api_keys, admin_keys = _client_keys(self._config)
        server = grpc.aio.server(
            options=server_options(self._config.max_message_bytes,
                                   self._config.max_concurrent_streams),
            interceptors=[*self.observability.aio_interceptors(),
                          *_auth_interceptors(api_keys, admin_keys),
                          RejectMalformedInterceptor()])
        generate_pb2_grpc.add_GenerateServiceServicer_to_server(self._servicer, server)
        chat_pb2_grpc.add_ChatServiceServicer_to_server(self._chat, server)
        admin_pb2_grpc.add_AdminServiceServicer_to_server(
            admin.AdminServicer(self.balancer,
                                restart_status_file=self._config.restart_status_file), server)
        self._health = await add_aio_health_and_reflection(
            server, [SERVICE_NAME, chat_service.SERVICE_NAME, admin.SERVICE_NAME],
            self._security.reflection)
        address = host_port(self._config.host, self._config.port)
        self.port = bind(server, address, self._security)
        await server.start()
        self._server = server
        if self._config.http_port >= 0:
            # The HTTP API serves no admin calls: any key the gRPC API takes is good there.
            http_api = self._http_api(frozenset(api_keys + admin_keys))
            self._http = HttpServer(http_api, self._config.host, self._config.http_port,
                                    self._security)
            await self._http.start()
            self.http_port = self._http.port
            self.http_scheme = self._http.scheme
        self._health_server = await start_aio_health_port(self._health, self._security)
        if self._config.coordinator:
            self._watcher = LoadWatcher(self._config.coordinator, self.balancer, self._security)
            self._watcher.start()
        else:
            await self.balancer.set_static(self._config.engines)
        return self.port

    async def stop(self, drain_timeout_s: float) -> None:
        """Go NOT_SERVING, refuse new calls, let running ones finish within
        `drain_timeout_s`, end the rest with UNAVAILABLE, stop."""
        self._draining = self._servicer.draining = True
        await self._publish_readiness()
        started = time.monotonic()
        await self._wait_until_idle(drain_timeout_s)
        left = self._servicer.num_running
        self._servicer.end_running(
            f"the frontend is shutting down; the request did not finish within the "
            f"{drain_timeout_s:g} s drain timeout")
        log.info("drained in %.2f s; %d requests left, ended with UNAVAILABLE",
                 time.monotonic() - started, left)
        await self._wait_until_idle(_FINAL_GRACE_S)
        if self._http is not None:
            await self._http.stop()
        if self._server is not None:
            await self._server.stop(_FINAL_GRACE_S)
        if self._health_server is not None:
            await self._health_server.stop(0)
        if self._watcher is not None:
            await self._watcher.close()
        await self.balancer.close()

    def _http_api(self, keys: frozenset[bytes]) -> OpenAIApi:
        config = self._config
        names = tuple(dict.fromkeys(n for n in (config.served_model_name, self._model.name,
                                                self._model.path) if n))
        settings = HttpSettings(model_names=names, max_model_len=self._model.max_model_len,
                                max_body_bytes=config.max_message_bytes, api_keys=keys)
        return OpenAIApi(settings, self._servicer, self._chat, lambda: self.balancer.ready)

    async def _wait_until_idle(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while self._servicer.num_running and time.monotonic() < deadline:
            await asyncio.sleep(0.05)

    def _on_readiness(self, ready: bool) -> None:
        task = asyncio.get_running_loop().create_task(self._publish_readiness())
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def _publish_readiness(self) -> None:
        # Publish the current state, not the event's: tasks may run late but the
        # last one to run always writes the truth.
        async with self._health_lock:
            if self._health is not None:
                await self._health.set_ready(self.balancer.ready and not self._draining)


def _client_keys(config: FrontendConfig) -> tuple[tuple[bytes, ...], tuple[bytes, ...]]:
    """(API keys, admin keys) from their files; both empty when auth is off."""
    api_keys = load_keys(config.api_key_file, "api_key_file") if config.api_key_file else ()
    admin_keys = (load_keys(config.admin_api_key_file, "admin_api_key_file")
                  if config.admin_api_key_file else ())
    return api_keys, admin_keys


def _auth_interceptors(api_keys: tuple[bytes, ...],
                       admin_keys: tuple[bytes, ...]) -> list[grpc.aio.ServerInterceptor]:
    if not api_keys and not admin_keys:
        return []
    return [BearerAuthInterceptor(api_keys, admin_keys, admin_services=[admin.SERVICE_NAME])]
