"""Reading a request's JSON body within the door's limits, every failure a client's:

- past `limit` bytes: 413 BODY_TOO_LARGE, told by Content-Length before anything is
  read, else as soon as the bytes read pass it (never buffered whole first);
- not all there within `timeout_s` (a slowloris body): 408 BODY_TIMEOUT;
- not UTF-8, not JSON: 400 naming `body`; so is a string holding a lone surrogate
  (JSON's `"\\ud800"` escape parses to one, and no proto string can hold it);
- nested deeper than MAX_JSON_DEPTH: 400. json.loads itself raises RecursionError
  near the interpreter's recursion limit, and deep values that parse would fail the
  same way later (pydantic, json.dumps, protobuf Structs, which stop at 100 levels).
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

import grpc
from starlette.requests import ClientDisconnect, Request

from services.frontend.errors import RequestError, invalid_argument

# protobuf's own recursion limit: a deeper value could not become a request proto.
MAX_JSON_DEPTH = 100


class ClientGone(Exception):
    """The client disconnected before its body was read; nobody is left to answer."""


def body_too_large(size: int, limit: int, source: str) -> RequestError:
    return RequestError(grpc.StatusCode.INVALID_ARGUMENT,
                        f"the request body has {size} bytes or more, at most {limit} are "
                        f"allowed ({source})", field="body", reason="BODY_TOO_LARGE")


async def read_body(request: Request, limit: int, timeout_s: float,
                    source: str = "--max-message-bytes") -> bytes:
    """The raw body, refused past `limit` bytes (`source` names where that limit is
    set) or `timeout_s` seconds."""
    length = request.headers.get("content-length", "")
    if length.isascii() and length.isdigit() and int(length) > limit:
        raise body_too_large(int(length), limit, source)
    chunks, size = [], 0
    try:
        async with asyncio.timeout(timeout_s):
            async for chunk in request.stream():
                size += len(chunk)
                if size > limit:
                    raise body_too_large(size, limit, source)
                chunks.append(chunk)
    except TimeoutError:
        raise RequestError(grpc.StatusCode.DEADLINE_EXCEEDED,
                           f"the request body did not arrive within {timeout_s:g} s "
                           "(--http-body-timeout-s)", field="body",
                           reason="BODY_TIMEOUT") from None
    except ClientDisconnect:
        raise ClientGone() from None
    return b"".join(chunks)


def parse_json(raw: bytes) -> Any:
    """The body's JSON value; 400 naming `body` when it is not UTF-8 JSON of a sane
    depth, or holds a string that is not Unicode text (a lone surrogate)."""
    try:
        # utf-8-sig: a leading byte-order mark is allowed, as json.loads(bytes) allows it.
        text = raw.decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        raise invalid_argument("body", f"the request body is not UTF-8: {exc}") from None
    try:
        value = json.loads(text)
    except RecursionError:
        raise _too_deep() from None
    except ValueError as exc:
        raise invalid_argument("body", f"the request body is not valid JSON: {exc}") from None
    _check_value(value)
    return value


def _too_deep() -> RequestError:
    return invalid_argument("body", f"the request body nests arrays and objects more than "
                                    f"{MAX_JSON_DEPTH} levels deep")


def _check_value(value: Any) -> None:
    # Iterative: the check must not hit the recursion limit it guards against.
    todo = [(value, 1)]
    while todo:
        item, depth = todo.pop()
        if isinstance(item, str):
            _check_text(item)
            continue
        if isinstance(item, dict):
            for key in item:
                _check_text(key)
            children: Any = item.values()
        elif isinstance(item, list):
            children = item
        else:
            continue
        if depth > MAX_JSON_DEPTH:
            raise _too_deep()
        todo.extend((child, depth + 1) for child in children)


def _check_text(text: str) -> None:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise invalid_argument("body", f"the request body has a string that is not Unicode "
                                       f"text: {exc.object[exc.start:exc.end]!r} at "
                                       f"character {exc.start} (a lone surrogate escape)"
                               ) from None
