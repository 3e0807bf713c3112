"""What every generating gRPC call does at its start (its request id, echoed back) and
at its end (a RequestError becomes the call's status)."""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator
from typing import TypeVar

import grpc

from services.frontend.errors import RequestError, to_status
from services.frontend.generate.validation import check_request_id

MAX_REQUEST_ID_CHARS = 256
T = TypeVar("T")


async def start_call(requested_id: str, context: grpc.aio.ServicerContext) -> str:
    """The call's request id, echoed as `x-request-id` metadata: the request's own, else
    the client's `x-request-id` metadata, else a new one."""
    metadata = dict(context.invocation_metadata() or ())
    request_id = requested_id or str(metadata.get("x-request-id", "")) or uuid.uuid4().hex
    try:
        check_request_id(request_id, MAX_REQUEST_ID_CHARS)
    except RequestError as e:
        await context.abort_with_status(to_status(e))
    await context.send_initial_metadata((("x-request-id", request_id),))
    return request_id


def call_metadata(context: grpc.aio.ServicerContext) -> dict[str, str]:
    return {key: str(value) for key, value in context.invocation_metadata() or ()}


async def aborting_on_error(chunks: AsyncIterator[T],
                            context: grpc.aio.ServicerContext) -> AsyncIterator[T]:
    """The chunks; a RequestError ends the gRPC call with its status."""
    try:
        async for chunk in chunks:
            yield chunk
    except RequestError as e:
        await context.abort_with_status(to_status(e))
