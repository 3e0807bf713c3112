"""gRPC calls by method and status code, for threaded and asyncio servers.

`corestream:grpc_server_started_total` counts calls as they arrive and
`corestream:grpc_server_handled_total` as they end, with the final code (a
streaming call counts when its stream ends), like go-grpc-prometheus.
"""

from __future__ import annotations

import asyncio
import inspect
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from typing import Any

import grpc
from prometheus_client import CollectorRegistry, Counter

from services.common.metrics import PREFIX

_LABELS = ("grpc_service", "grpc_method")
_CODES = {code.value[0]: code for code in grpc.StatusCode}


def _split(full_method: str) -> tuple[str, str]:
    service, _, method = full_method.lstrip("/").partition("/")
    return service, method


def _code(context: Any, error: BaseException | None) -> str:
    code = context.code()
    if isinstance(code, int):  # the asyncio context reports the raw value
        code = _CODES.get(code)
    if code is not None:
        # A code the handler set stands even if its task is cancelled afterwards: the
        # asyncio context's abort sends the status before it raises, so the client may
        # already have it when a server stop cancels the handler.
        return str(code.name)
    if isinstance(error, asyncio.CancelledError | GeneratorExit) or _cancelled(context):
        # The client went away; a handler that noticed may still have returned normally.
        return grpc.StatusCode.CANCELLED.name
    return grpc.StatusCode.OK.name if error is None else grpc.StatusCode.UNKNOWN.name


def _cancelled(context: Any) -> bool:
    cancelled = getattr(context, "cancelled", None)  # the asyncio context (a Cython class)
    if cancelled is not None:
        return bool(cancelled())
    return not context.is_active()


def _wrap(handler: Any, wrap: Callable[[Any, bool], Any]) -> Any:
    if handler is None:
        return None
    if handler.request_streaming and handler.response_streaming:
        return grpc.stream_stream_rpc_method_handler(
            wrap(handler.stream_stream, True), handler.request_deserializer,
            handler.response_serializer)
    if handler.request_streaming:
        return grpc.stream_unary_rpc_method_handler(
            wrap(handler.stream_unary, False), handler.request_deserializer,
            handler.response_serializer)
    if handler.response_streaming:
        return grpc.unary_stream_rpc_method_handler(
            wrap(handler.unary_stream, True), handler.request_deserializer,
            handler.response_serializer)
    return grpc.unary_unary_rpc_method_handler(
        wrap(handler.unary_unary, False), handler.request_deserializer,
        handler.response_serializer)


class GrpcMetrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        self.started = Counter(f"{PREFIX}grpc_server_started", "RPCs started on the server.",
                               _LABELS, registry=registry)
        self.handled = Counter(f"{PREFIX}grpc_server_handled",
                               "RPCs completed on the server, by status code.",
                               (*_LABELS, "grpc_code"), registry=registry)

    def interceptor(self) -> grpc.ServerInterceptor:
        return _Interceptor(self)

    def aio_interceptor(self) -> grpc.aio.ServerInterceptor:
        return _AioInterceptor(self)

    def _start(self, full_method: str) -> tuple[str, str]:
        service, method = _split(full_method)
        self.started.labels(service, method).inc()
        return service, method

    def _end(self, names: tuple[str, str], context: Any, error: BaseException | None) -> None:
        self.handled.labels(*names, _code(context, error)).inc()


class _Interceptor(grpc.ServerInterceptor):
    def __init__(self, metrics: GrpcMetrics) -> None:
        self._metrics = metrics

    def intercept_service(self, continuation: Any, details: Any) -> Any:
        metrics = self._metrics
        full_method = details.method

        def wrap(behavior: Callable[..., Any], streaming: bool) -> Callable[..., Any]:
            def unary(request: Any, context: Any) -> Any:
                names = metrics._start(full_method)
                try:
                    response = behavior(request, context)
                except BaseException as e:
                    metrics._end(names, context, e)
                    raise
                metrics._end(names, context, None)
                return response

            def stream(request: Any, context: Any) -> Iterator[Any]:
                names = metrics._start(full_method)
                try:
                    yield from behavior(request, context)
                except BaseException as e:
                    metrics._end(names, context, e)
                    raise
                metrics._end(names, context, None)

            return stream if streaming else unary

        return _wrap(continuation(details), wrap)


class _AioInterceptor(grpc.aio.ServerInterceptor):
    def __init__(self, metrics: GrpcMetrics) -> None:
        self._metrics = metrics

    async def intercept_service(
        self, continuation: Callable[[Any], Awaitable[Any]], details: Any
    ) -> Any:
        metrics = self._metrics
        full_method = details.method

        def wrap(behavior: Callable[..., Any], streaming: bool) -> Callable[..., Any]:
            async def unary(request: Any, context: Any) -> Any:
                names = metrics._start(full_method)
                try:
                    response = await behavior(request, context)
                except BaseException as e:
                    metrics._end(names, context, e)
                    raise
                metrics._end(names, context, None)
                return response

            async def stream(request: Any, context: Any) -> AsyncIterator[Any]:
                names = metrics._start(full_method)
                try:
                    async for response in behavior(request, context):
                        yield response
                except BaseException as e:
                    metrics._end(names, context, e)
                    raise
                metrics._end(names, context, None)

            # A streaming handler may also be a coroutine that writes with context.write.
            return stream if streaming and inspect.isasyncgenfunction(behavior) else unary

        return _wrap(await continuation(details), wrap)
