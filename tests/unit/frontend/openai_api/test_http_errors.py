"""The HTTP edge's renaming of proto fields and its X-Request-Id, on their own (the
app's error paths end to end are in test_app.py)."""

from __future__ import annotations

import grpc
import pytest
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route
from starlette.testclient import TestClient

from services.frontend.errors import RequestError, invalid_argument
from services.frontend.openai_api.http_errors import (
    RequestIds,
    error_body,
    http_exception,
    internal_error,
    openai_field,
)
from services.frontend.openai_api.schemas import CHAT_NAMES, COMPLETION_NAMES


@pytest.mark.parametrize(("field", "names", "expected"), [
    ("sampling.temperature", COMPLETION_NAMES, "temperature"),
    ("sampling.logprobs", COMPLETION_NAMES, "logprobs"),
    ("sampling.logprobs", CHAT_NAMES, "top_logprobs"),
    ("sampling.json_schema", {"sampling.json_schema": "guided_json"}, "guided_json"),
    ("text", COMPLETION_NAMES, "prompt"),
    ("token_ids.ids", COMPLETION_NAMES, "prompt"),
    ("prompt", CHAT_NAMES, "messages"),
    ("messages[2].content_parts", CHAT_NAMES, "messages[2].content"),
    ("tool_choice.function", CHAT_NAMES, "tool_choice.function.name"),
    ("request_id", CHAT_NAMES, "request_id"),
])
def test_proto_fields_take_the_bodys_names(field: str, names: dict[str, str],
                                           expected: str) -> None:
    assert openai_field(field, names) == expected


def test_an_error_body_renames_its_message_and_lowers_its_code() -> None:
    error = invalid_argument("sampling.min_tokens", "sampling.min_tokens must be <= "
                             "sampling.max_tokens (4), got 9", reason="PROMPT_TOO_LONG")
    status, body = error_body(error, {"sampling.max_tokens": "max_completion_tokens"})
    assert status == 400
    assert body["error"] == {
        "message": "min_tokens must be <= max_completion_tokens (4), got 9",
        "type": "invalid_request_error", "param": "min_tokens", "code": "prompt_too_long"}
    _, body = error_body(RequestError(grpc.StatusCode.UNAVAILABLE, "no engine"))
    assert (body["error"]["param"], body["error"]["code"]) == (None, "unavailable")


async def _boom(request: Request) -> Response:
    raise RuntimeError("a bug")


async def _named(request: Request) -> Response:
    return Response(headers={"X-Request-Id": "from-the-body"})


def _client() -> TestClient:
    app = Starlette(routes=[Route("/boom", _boom), Route("/named", _named)],
                    middleware=[Middleware(RequestIds)],
                    exception_handlers={HTTPException: http_exception,
                                        Exception: internal_error})
    return TestClient(app, raise_server_exceptions=False)


def test_every_response_has_a_request_id_a_bug_included() -> None:
    with _client() as client:
        response = client.get("/boom", headers={"X-Request-Id": "mine"})
        assert response.status_code == 500
        assert response.json()["error"]["code"] == "internal_error"
        assert response.headers["x-request-id"] == "mine"
        fresh = client.get("/boom")
        assert len(fresh.headers["x-request-id"]) == 32
        # A bad id is not echoed; a handler's own id is kept.
        assert client.get("/nowhere", headers={"X-Request-Id": "x" * 10000}).headers[
            "x-request-id"] != "x" * 10000
        assert client.get("/named", headers={"X-Request-Id": "mine"}).headers[
            "x-request-id"] == "from-the-body"
