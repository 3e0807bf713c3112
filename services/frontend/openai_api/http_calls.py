"""What every HTTP call onto the request path does, whichever route takes it: settle
its request id, hand on its headers as metadata, and answer with the JSON of its work,
or with nothing (499) when the client leaves first, which cancels the work and so
aborts the request in the engines."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Mapping
from typing import Any

from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response

from services.frontend.errors import RequestError, invalid_argument
from services.frontend.generate.validation import check_request_id
from services.frontend.grpc_calls import MAX_REQUEST_ID_CHARS
from services.frontend.openai_api.http_errors import error_response


def request_id(request: Request, body_id: str | None) -> str:
    """The body's request_id, else the client's X-Request-Id, else the id `RequestIds`
    made; a bad one the client gave is refused."""
    request_id = (body_id or request.headers.get("x-request-id")
                  or request.scope["state"]["request_id"])
    check_request_id(request_id, MAX_REQUEST_ID_CHARS)
    if request_id != request_id.strip(" "):
        # An HTTP header value cannot begin or end with a space: h11 refused to send the
        # answer's X-Request-Id, and the client got a closed connection, not an answer.
        raise invalid_argument("request_id", "request_id must not begin or end with a "
                               "space (it is echoed as the X-Request-Id header)")
    return request_id


def call_metadata(request: Request) -> dict[str, str]:
    # Starlette gives lower-case names, as gRPC metadata has them (traceparent, ...).
    return dict(request.headers)


async def whole(request: Request, work: Awaitable[Any],
                request_id: str, names: Mapping[str, str] | None = None) -> Response:
    """The JSON of `work`, cancelled (and the request aborted) if the client leaves."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_disconnected(request))
    try:
        await asyncio.wait((task, watcher), return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
    if not task.done():
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError, RequestError):
            await task
        return Response(status_code=499)
    try:
        return JSONResponse(task.result(), headers={"X-Request-Id": request_id})
    except RequestError as e:
        return error_response(e, request_id, names)


async def _disconnected(request: Request) -> None:
    with contextlib.suppress(ClientDisconnect):
        while True:
            message = await request.receive()
            if message["type"] == "http.disconnect":
                return
