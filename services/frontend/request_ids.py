"""Request ids: where a call's id comes from, and how it is echoed back."""

from __future__ import annotations

import uuid

import grpc

from services.frontend.errors import RequestError, to_status
from services.frontend.validation import check_request_id

MAX_REQUEST_ID_CHARS = 256


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
