"""The OpenAI-compatible HTTP API: a second door onto the frontend's request path.

`/v1/completions` and `/v1/chat/completions` turn the JSON body into the same
request protos the gRPC API takes and run them on the same request path (pipeline.py
and, for chat, chat/answering.py: validation, limits, routing, telemetry, abort), in
process: no loopback gRPC call.
Errors come back in OpenAI's shape with the HTTP status matching the gRPC code.
`/health` and `/metrics` (the frontend's Prometheus registry) sit beside the API, and
vLLM's routes for RL trainers (pause, resume, live weight updates: rl_routes.py) and
for pooling models (embeddings, score, rerank, classify: pooling_routes.py), and
SGLang's worker routes for its model gateway (/generate, /v1/loads: sglang_routes.py).

Starlette serves it under uvicorn, on the frontend's own event loop. A client that
disconnects cancels its request's task, which aborts the request in the engine.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import socket
import ssl
import time
from collections.abc import AsyncIterator, Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any, TypeVar

import grpc
import pydantic
import uvicorn
from corestream.generate.v1 import generate_service_pb2 as generate_pb2
from prometheus_client import CollectorRegistry
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from services.common.metrics import exposition
from services.common.ports import unavailable
from services.common.security_config import PLAINTEXT, SecurityConfig
from services.frontend.chat.answering import ChatAnswering
from services.frontend.collect import collect_chat, collect_generate
from services.frontend.errors import RequestError, invalid_argument
from services.frontend.openai_api import http_calls, openapi, responses
from services.frontend.openai_api.http_errors import (
    RequestIds,
    error_response,
    http_exception,
    internal_error,
)
from services.frontend.openai_api.http_protocol import HttpLimits, protocol_class
from services.frontend.openai_api.json_body import ClientGone, parse_json, read_body
from services.frontend.openai_api.pooling_routes import PoolingRoutes
from services.frontend.openai_api.rl_routes import RlRoutes
from services.frontend.openai_api.schemas import (
    CHAT_NAMES,
    COMPLETION_NAMES,
    ChatCompletionBody,
    CompletionBody,
    chat_names,
    chat_request,
    completion_names,
    completion_requests,
)
from services.frontend.openai_api.sglang_routes import SglangRoutes, WorkerState
from services.frontend.openai_api.sse import sse_response
from services.frontend.pipeline import Pipeline
from services.frontend.pooling.operations import PoolingOperations
from services.frontend.weight_sync import WeightSync

T = TypeVar("T")



@dataclass(frozen=True)
class HttpSettings:
    model_names: tuple[str, ...]
    """Names a request's `model` may give; the first is the one reported."""
    max_model_len: int
    max_body_bytes: int
    api_keys: frozenset[bytes]
    """Empty: no authentication."""
    admin_keys: frozenset[bytes] = frozenset()
    """Keys the RL routes (rl_routes.py) take when there are any; else those take the
    API keys, as the gRPC AdminService does."""
    root: str = ""
    """The checkpoint served (its path or name), /v1/models' `root`."""
    limits: HttpLimits = HttpLimits()


class OpenAIApi:
    def __init__(self, settings: HttpSettings, pipeline: Pipeline,
                 chat: ChatAnswering, is_ready: Callable[[], bool],
                 registry: CollectorRegistry, weight_sync: WeightSync | None = None,
                 pooling: PoolingOperations | None = None,
                 worker_state: WorkerState | None = None) -> None:
        """`worker_state`: serve SGLang's worker routes (sglang_routes.py) from it."""
        self._settings = settings
        self._pipeline = pipeline
        self._chat = chat
        self._is_ready = is_ready
        self._registry = registry
        self._created = int(time.time())
        pooler = pooling.pooler if pooling is not None else None
        self._tasks = pooler.tasks if pooler is not None else ("generate",)
        self.app = Starlette(
            routes=[
                Route("/v1/models", self.models, methods=["GET"]),
                Route("/v1/completions", self.completions, methods=["POST"]),
                Route("/v1/chat/completions", self.chat_completions, methods=["POST"]),
                Route("/health", self.health, methods=["GET"]),
                Route("/metrics", self.metrics, methods=["GET"]),
                Route("/openapi.json", self.openapi, methods=["GET"]),
                *(RlRoutes(weight_sync, self._authenticate_admin,
                           settings.limits.body_timeout_s).routes()
                  if weight_sync is not None else []),
                *(PoolingRoutes(pooling, self.model, settings.max_model_len,
                                self._authenticate, self._body).routes()
                  if pooling is not None else []),
                *(SglangRoutes(worker_state, pipeline, self._tasks, self._authenticate,
                               self._body, is_ready).routes()
                  if worker_state is not None else []),
            ],
            middleware=[Middleware(RequestIds)],
            exception_handlers={HTTPException: http_exception, ClientGone: _client_gone,
                                Exception: internal_error},
        )
        self._openapi: dict[str, Any] | None = None

    @property
    def model(self) -> str:
        return self._settings.model_names[0]

    @property
    def limits(self) -> HttpLimits:
        return self._settings.limits

    async def health(self, request: Request) -> Response:
        ready = self._is_ready() and not self._pipeline.draining
        return Response(status_code=200 if ready else 503)

    async def metrics(self, request: Request) -> Response:
        """The frontend's own registry, as its --metrics-port serves it. No API key, like
        /health: the metrics port asks for none either, and scrapers carry none."""
        # Collecting reads every collector (the process's /proc among them): off the loop.
        body, content_type = await asyncio.to_thread(
            exposition, self._registry, request.headers.get("accept", ""))
        return Response(body, headers={"Content-Type": content_type})

    async def openapi(self, request: Request) -> Response:
        """The OpenAPI 3.1 description of the routes this door serves (openapi.py). No
        API key: it describes the door, as /health reports on it."""
        if self._openapi is None:
            self._openapi = openapi.document(self.app.routes,
                                             auth=bool(self._settings.api_keys),
                                             model_names=self._settings.model_names)
        return JSONResponse(self._openapi)

    async def models(self, request: Request) -> Response:
        try:
            self._authenticate(request)
        except RequestError as e:
            return error_response(e)
        return JSONResponse(responses.models_list(self.model, self._created,
                                                  self._settings.max_model_len, self._tasks,
                                                  self._settings.root))

    async def completions(self, request: Request) -> Response:
        names: Mapping[str, str] = COMPLETION_NAMES
        try:
            self._authenticate(request)
            body = await self._body(request, CompletionBody)
            names = completion_names(body)
            request_id = http_calls.request_id(request, body.request_id)
            protos = completion_requests(body)
        except RequestError as e:
            return self._refused(e, names)
        metadata = http_calls.call_metadata(request)
        n = max(1, body.n or 1)
        streams = []
        for i, proto in enumerate(protos):
            # One engine request per prompt; the client's id names the first.
            proto.request_id = request_id if len(protos) == 1 else f"{request_id}-p{i}"
            streams.append(_indexed(self._pipeline.generate(proto.request_id, proto, metadata),
                                    i * n))
        created = int(time.time())
        rid = f"cmpl-{request_id}"
        logprobs = body.logprobs is not None
        if body.stream:
            events = self._completion_events(_merged(streams), rid, created, logprobs,
                                             body.include_usage, body.return_token_ids)
            return await sse_response(events, request_id, names)

        async def whole() -> dict[str, Any]:
            choices = []
            results = await asyncio.gather(
                *(collect_generate(request_id, _plain(stream)) for stream in streams))
            prompt_logprobs = {}
            for i, result in enumerate(results):
                for completion in result.completions:
                    choices.append((i * n + completion.index, completion))
                    prompt_logprobs[i * n + completion.index] = result.prompt_logprobs
            usage = responses.sum_usage(result.usage for result in results)
            return responses.completion_response(
                choices, usage, id=rid, model=self.model, created=created, logprobs=logprobs,
                prompt_logprobs=prompt_logprobs if body.prompt_logprobs is not None else None,
                token_ids=body.return_token_ids,
                # Every prompt has the same constraint: its warnings once.
                warnings=results[0].warnings if results else ())

        return await http_calls.whole(request, whole(), request_id, names)

    async def _completion_events(
        self, chunks: AsyncIterator[tuple[int, generate_pb2.GenerateStreamResponse]],
        rid: str, created: int, logprobs: bool, include_usage: bool, token_ids: bool,
    ) -> AsyncIterator[dict[str, Any]]:
        usages = []  # one per prompt, on its last chunk
        offsets = responses.CompletionLogprobs()
        async for base, chunk in chunks:
            index = base + chunk.index
            if (chunk.text or chunk.finish_reason or chunk.logprobs or chunk.warnings
                    or (token_ids and chunk.token_ids)):
                yield responses.completion_chunk(
                    chunk, id=rid, model=self.model, created=created, index=index,
                    logprobs=offsets if logprobs else None, token_ids=token_ids)
            if chunk.HasField("usage"):
                usages.append(chunk.usage)
        if include_usage:
            yield responses.usage_chunk(responses.sum_usage(usages), id=rid, model=self.model,
                                        created=created, object="text_completion")

    async def chat_completions(self, request: Request) -> Response:
        names: Mapping[str, str] = CHAT_NAMES
        try:
            self._authenticate(request)
            body = await self._body(request, ChatCompletionBody)
            names = chat_names(body)
            request_id = http_calls.request_id(request, body.request_id)
            proto = chat_request(body)
        except RequestError as e:
            return self._refused(e, names)
        proto.request_id = request_id
        answer = self._chat.answer(request_id, proto, http_calls.call_metadata(request))
        created = int(time.time())
        rid = f"chatcmpl-{request_id}"
        logprobs = bool(body.logprobs)
        if body.stream:
            events = self._chat_events(answer, rid, created, body.include_usage)
            return await sse_response(events, request_id, names)

        async def whole() -> dict[str, Any]:
            result = await collect_chat(request_id, answer)
            return responses.chat_response(result, id=rid, model=self.model, created=created,
                                           logprobs=logprobs)

        return await http_calls.whole(request, whole(), request_id, names)

    async def _chat_events(self, answer: AsyncIterator[Any], rid: str, created: int,
                           include_usage: bool) -> AsyncIterator[dict[str, Any]]:
        started: set[int] = set()
        usage = None
        async for delta in answer:
            first = delta.index not in started
            started.add(delta.index)
            if delta.HasField("usage"):
                usage = delta.usage
            yield responses.chat_chunk(delta, id=rid, model=self.model, created=created,
                                       first=first)
        if include_usage and usage is not None:
            yield responses.usage_chunk(usage, id=rid, model=self.model, created=created,
                                        object="chat.completion.chunk")

    def _refused(self, error: RequestError, names: Mapping[str, str]) -> Response:
        """A completion or chat request the door refused before the request path: its
        body did not parse or convert. Counted as the path counts its own refusals (a
        missing API key is not a request, and is not counted, as on gRPC)."""
        if error.code is not grpc.StatusCode.UNAUTHENTICATED:
            self._pipeline.count_refused(error)
        return error_response(error, names=names)

    def _authenticate_admin(self, request: Request) -> None:
        admin_keys = self._settings.admin_keys
        self._authenticate(request, admin_keys or self._settings.api_keys,
                           "an admin key" if admin_keys else "a valid API key")

    def _authenticate(self, request: Request, keys: frozenset[bytes] | None = None,
                      what: str = "a valid API key") -> None:
        keys = self._settings.api_keys if keys is None else keys
        if not keys:
            return
        scheme, _, key = request.headers.get("authorization", "").partition(" ")
        given = key.strip().encode()
        # Compared in constant time, as the gRPC interceptor does.
        if scheme.lower() != "bearer" or not any(hmac.compare_digest(given, k) for k in keys):
            raise RequestError(grpc.StatusCode.UNAUTHENTICATED,
                               f"{what} is required: 'Authorization: Bearer <key>'",
                               reason="UNAUTHENTICATED")

    async def _body(self, request: Request, schema: type[T]) -> T:
        limits = self._settings.limits
        data = parse_json(await read_body(request, self._settings.max_body_bytes,
                                          limits.body_timeout_s))
        try:
            body = schema.model_validate(data)  # type: ignore[attr-defined]
        except pydantic.ValidationError as exc:
            raise _validation_error(exc) from None
        # The pooling bodies may leave `model` out (vLLM's): the served one.
        if body.model is not None and body.model not in self._settings.model_names:
            raise RequestError(
                grpc.StatusCode.NOT_FOUND,
                f"the model {body.model!r} does not exist; this server serves {self.model!r}",
                field="model", reason="MODEL_NOT_FOUND")
        return body


async def _client_gone(request: Request, exc: Exception) -> Response:
    # Nobody reads this answer; 499 (nginx's "client closed request") for the logs.
    return Response(status_code=499)


def _validation_error(exc: pydantic.ValidationError) -> RequestError:
    first = exc.errors()[0]
    param = ".".join(str(part) for part in first["loc"])
    return invalid_argument(param, f"{param}: {first['msg']}" if param else first["msg"])


async def _indexed(chunks: AsyncIterator[T], base: int) -> AsyncIterator[tuple[int, T]]:
    async for chunk in chunks:
        yield base, chunk


async def _plain(chunks: AsyncIterator[tuple[int, T]]) -> AsyncIterator[T]:
    async for _, chunk in chunks:
        yield chunk


async def _merged(streams: Iterable[AsyncIterator[T]]) -> AsyncIterator[T]:
    """The items of several streams as they come; the first failure ends them all."""
    streams = list(streams)
    if len(streams) == 1:
        async for item in streams[0]:
            yield item
        return
    queue: asyncio.Queue[tuple[str, Any]] = asyncio.Queue()

    async def pump(stream: AsyncIterator[T]) -> None:
        try:
            async for item in stream:
                await queue.put(("item", item))
        except Exception as exc:  # handed to the consumer, which raises it
            await queue.put(("error", exc))
        finally:
            await queue.put(("done", None))

    tasks = [asyncio.ensure_future(pump(stream)) for stream in streams]
    try:
        done = 0
        while done < len(tasks):
            kind, value = await queue.get()
            if kind == "item":
                yield value
            elif kind == "error":
                raise value
            else:
                done += 1
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


class _Server(uvicorn.Server):
    # The frontend owns SIGTERM/SIGINT (it drains); uvicorn must not take them over.
    @contextlib.contextmanager
    def capture_signals(self) -> Any:
        yield


class HttpServer:
    """uvicorn serving the API on the running event loop.

    With TLS configured the port serves HTTPS with the gRPC port's certificate and,
    where the gRPC port requires client certificates, requires them too: the HTTP door
    must not be a plaintext way around the gRPC port's protection.
    """

    def __init__(self, api: OpenAIApi, host: str, port: int,
                 security: SecurityConfig = PLAINTEXT) -> None:
        self._sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET)
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            self._sock.bind((host, port))
        except OSError as exc:
            self._sock.close()
            raise unavailable(host, port, "--http-port", exc) from None
        self.port = int(self._sock.getsockname()[1])
        self.scheme = "https" if security.tls else "http"
        tls: dict[str, Any] = {}
        if security.tls:
            tls = {"ssl_certfile": security.tls_cert, "ssl_keyfile": security.tls_key,
                   "ssl_ca_certs": security.tls_ca or None,
                   "ssl_cert_reqs": ssl.CERT_REQUIRED
                   if security.mtls and security.require_client_cert else ssl.CERT_NONE}
        limits = api.limits
        # h11 (not httptools): the guarded protocol adds the timeouts uvicorn lacks.
        self._server = _Server(uvicorn.Config(
            api.app, log_config=None, access_log=False, lifespan="off",
            timeout_graceful_shutdown=1, http=protocol_class(limits),
            timeout_keep_alive=limits.keep_alive_s, **tls))
        self._task: asyncio.Task[None] | None = None

    async def start(self) -> None:
        self._task = asyncio.ensure_future(self._server.serve(sockets=[self._sock]))
        while not self._server.started:
            if self._task.done():
                self._task.result()  # raises what stopped it
            await asyncio.sleep(0.01)

    async def stop(self) -> None:
        if self._task is None:
            return
        self._server.should_exit = True
        await self._task
        self._sock.close()
