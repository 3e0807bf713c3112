"""Malformed request bytes are the client's error: INVALID_ARGUMENT, not UNKNOWN.

grpcio answers a request that fails to parse (bad wire format, a string field with
invalid UTF-8) with UNKNOWN and a Python exception name. This interceptor gives
unary-request handlers a deserializer that never raises; a request that did not
parse reaches a wrapper that aborts with INVALID_ARGUMENT and the parser's message,
and the servicer never sees it.
"""

from __future__ import annotations

import inspect
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import grpc
from google.protobuf.message import DecodeError


class _Malformed:
    def __init__(self, reason: str) -> None:
        self.reason = reason


def _message(method: str, reason: str) -> str:
    return f"the request to {method} is not a valid protobuf message: {reason}"


class RejectMalformedInterceptor(grpc.aio.ServerInterceptor):
    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(handler_call_details)
        if handler is None or handler.request_streaming or handler.request_deserializer is None:
            return handler
        parse = handler.request_deserializer
        method = handler_call_details.method

        def deserialize(data: bytes) -> Any:
            try:
                return parse(data)
            except DecodeError as exc:
                return _Malformed(str(exc))

        if handler.response_streaming:
            stream = handler.unary_stream
            if not inspect.isasyncgenfunction(stream):
                return handler

            async def unary_stream(request: Any, context: grpc.aio.ServicerContext
                                   ) -> AsyncIterator[Any]:
                if isinstance(request, _Malformed):
                    await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                        _message(method, request.reason))
                async for response in stream(request, context):
                    yield response

            return grpc.unary_stream_rpc_method_handler(
                unary_stream, deserialize, handler.response_serializer)

        unary = handler.unary_unary
        if not inspect.iscoroutinefunction(unary):
            return handler

        async def unary_unary(request: Any, context: grpc.aio.ServicerContext) -> Any:
            if isinstance(request, _Malformed):
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                    _message(method, request.reason))
            return await unary(request, context)

        return grpc.unary_unary_rpc_method_handler(
            unary_unary, deserialize, handler.response_serializer)
