"""Failures in OpenAI's error shape, and an X-Request-Id on every HTTP response.

The request path reports failures as `RequestError`s named in proto terms, as the
gRPC door shows them (`sampling.temperature`, `token_ids.ids[3]`, reason
`PROMPT_TOO_LONG`). Here, at the HTTP edge, they are renamed once for the OpenAI
body the client sent: `param` and the message both say `temperature` and
`prompt[3]`, and `code` is the reason in lower snake case (`prompt_too_long`; the
gRPC status name, e.g. `invalid_argument`, when there is no reason). The framework's
own refusals (unknown route, wrong method) and unexpected failures take the same
shape.

`RequestIds` gives every response an X-Request-Id, those refused before the request
was read included: the client's own when it sent a valid one, else a new one. A
handler that settles another id (a body's `request_id`) sets the header itself.
"""

from __future__ import annotations

import logging
import math
import re
import uuid
from collections.abc import Mapping
from typing import Any

import grpc
from starlette.datastructures import Headers, MutableHeaders
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from services.frontend.errors import RequestError
from services.frontend.generate.validation import check_request_id
from services.frontend.grpc_calls import MAX_REQUEST_ID_CHARS
from services.frontend.openai_api import responses

log = logging.getLogger(__name__)

# gRPC codes as HTTP statuses and OpenAI error types.
_HTTP_STATUS = {
    grpc.StatusCode.INVALID_ARGUMENT: (400, "invalid_request_error"),
    grpc.StatusCode.OUT_OF_RANGE: (400, "invalid_request_error"),
    grpc.StatusCode.FAILED_PRECONDITION: (400, "invalid_request_error"),
    grpc.StatusCode.UNAUTHENTICATED: (401, "authentication_error"),
    grpc.StatusCode.PERMISSION_DENIED: (403, "permission_error"),
    grpc.StatusCode.NOT_FOUND: (404, "not_found_error"),
    grpc.StatusCode.ALREADY_EXISTS: (409, "invalid_request_error"),
    grpc.StatusCode.RESOURCE_EXHAUSTED: (429, "rate_limit_error"),
    grpc.StatusCode.CANCELLED: (499, "cancelled"),
    grpc.StatusCode.UNAVAILABLE: (503, "service_unavailable"),
    grpc.StatusCode.DEADLINE_EXCEEDED: (504, "timeout"),
}

# Failures of the HTTP exchange itself, which HTTP names more exactly than the gRPC code
# the request path reports them with.
_REASON_STATUS = {
    "BODY_TOO_LARGE": (413, "invalid_request_error"),
    "BODY_TIMEOUT": (408, "timeout"),
}

# Proto field paths as the OpenAI bodies name them, in `param` and in messages.
# A `sampling.<name>` not listed in a request's own names is `<name>`.
_SAMPLING_FIELD = re.compile(r"\bsampling\.([a-z_]+)")
_RENAMES = (
    (re.compile(r"\btoken_ids(?:\.ids)?\b"), "prompt"),
    (re.compile(r"\.content_parts\b"), ".content"),
    (re.compile(r"\btool_choice\.function\b(?!\.)"), "tool_choice.function.name"),
)


def openai_field(field: str, names: Mapping[str, str]) -> str:
    """A proto field path (`sampling.top_k`, `messages[2].content_parts`) as the OpenAI
    body names it; `names` gives the request's own renames of whole fields."""
    if field in names:
        return names[field]
    field = _SAMPLING_FIELD.sub(lambda m: names.get(m.group(0), m.group(1)), field)
    for pattern, replacement in _RENAMES:
        field = pattern.sub(replacement, field)
    return field


def _openai_message(message: str, names: Mapping[str, str]) -> str:
    # Only paths are renamed in prose: "prompt" and "text" are also English words.
    message = _SAMPLING_FIELD.sub(lambda m: names.get(m.group(0), m.group(1)), message)
    for pattern, replacement in _RENAMES:
        message = pattern.sub(replacement, message)
    return message


def error_body(error: RequestError,
               names: Mapping[str, str] | None = None) -> tuple[int, dict[str, Any]]:
    """The HTTP status and OpenAI error body of a failure; `names`: the request's
    renames of whole fields (schemas.completion_names, schemas.chat_names)."""
    names = names or {}
    status, kind = _REASON_STATUS.get(error.reason) or _HTTP_STATUS.get(
        error.code, (500, "internal_error"))
    param = openai_field(error.field, names) if error.field else None
    message = _openai_message(error.message, names)
    if param is not None and param not in message:
        # A whole field renamed ("prompt" of a chat request is its "messages").
        message = f"{param}: {message}"
    code = (error.reason or error.code.name).lower()
    return status, responses.error_body(message, kind, param, code)


def error_response(error: RequestError, request_id: str | None = None,
                   names: Mapping[str, str] | None = None) -> JSONResponse:
    """The failure as a response; without `request_id`, `RequestIds` names it."""
    status, body = error_body(error, names)
    headers = {"X-Request-Id": request_id} if request_id else {}
    if error.retry_after_s is not None:
        headers["Retry-After"] = str(max(1, math.ceil(error.retry_after_s)))
    return JSONResponse(body, status_code=status, headers=headers)


async def http_exception(request: Request, exc: Exception) -> Response:
    """Starlette's own refusals (no such route, a method the route does not take)."""
    assert isinstance(exc, HTTPException)
    if exc.status_code == 404:
        message = f"no such path: {request.url.path}"
        kind, code = "not_found_error", "not_found"
    elif exc.status_code == 405:
        allowed = (exc.headers or {}).get("Allow", "")
        message = f"{request.method} is not allowed on {request.url.path} (allowed: {allowed})"
        kind, code = "invalid_request_error", "method_not_allowed"
    else:
        message, kind = exc.detail, "invalid_request_error"
        code = re.sub(r"\W+", "_", exc.detail.lower()).strip("_") or "http_error"
    return JSONResponse(responses.error_body(message, kind, None, code),
                        status_code=exc.status_code, headers=exc.headers)


async def internal_error(request: Request, exc: Exception) -> Response:
    """A bug: logged, and answered in the same shape (the server's error middleware
    sends this one past `RequestIds`, so it names the id itself)."""
    request_id = request.scope.get("state", {}).get("request_id", "")
    log.exception("request %s failed", request_id, exc_info=exc)
    return JSONResponse(responses.error_body("internal server error", "internal_error", None,
                                             "internal_error"),
                        status_code=500, headers={"X-Request-Id": request_id})


def client_request_id(headers: Headers) -> str | None:
    """The client's X-Request-Id when it is a valid id; None when absent or not."""
    request_id = headers.get("x-request-id")
    if not request_id:
        return None
    try:
        check_request_id(request_id, MAX_REQUEST_ID_CHARS)
    except RequestError:
        return None
    return request_id


class RequestIds:
    """ASGI middleware: `scope["state"]["request_id"]` is the client's X-Request-Id or
    a new id, and every response without the header gets it."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        request_id = client_request_id(Headers(scope=scope)) or uuid.uuid4().hex
        scope.setdefault("state", {})["request_id"] = request_id

        async def send_with_id(message: Message) -> None:
            if message["type"] == "http.response.start":
                headers = MutableHeaders(scope=message)
                if "x-request-id" not in headers:
                    headers["X-Request-Id"] = request_id
            await send(message)

        await self.app(scope, receive, send_with_id)
