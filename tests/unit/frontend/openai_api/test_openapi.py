"""The HTTP door's OpenAPI document (openapi.py) and the body checks every route shares
(json_body.py), against a FrontendServer in front of a scripted engine."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any
from unittest import mock

import pytest
import schemathesis

from services.frontend.config import FrontendConfig
from services.frontend.openai_api import openapi
from services.frontend.openai_api.http_protocol import HttpLimits, http_limits
from services.frontend.openai_api.json_body import MAX_JSON_DEPTH
from services.frontend.openai_api.pooling_routes import PoolingRoutes
from services.frontend.openai_api.rl_routes import RlRoutes
from services.frontend.openai_api.sglang_routes import SglangRoutes
from tests.unit.frontend.fakes import CHAT_MODEL as MODEL
from tests.unit.frontend.openai_api.error_body import assert_openai_error
from tests.unit.frontend.openai_api.serving import KEY, Env, serve

USER = [{"role": "user", "content": "hi"}]


def test_every_route_of_every_part_is_documented() -> None:
    # The parts' constructors only keep their collaborators: mocks give their routes.
    fake = mock.MagicMock()
    routes = [*RlRoutes(fake, fake, 1.0).routes(),
              *PoolingRoutes(fake, "m", 8, fake, fake).routes(),
              *SglangRoutes(fake, fake, ("generate",), fake, fake, fake).routes()]
    missing = [key for key in openapi.served(routes) if key not in openapi.OPERATIONS]
    assert not missing, f"routes without an entry in openapi.OPERATIONS: {missing}"


@pytest.mark.timeout(30)
def test_the_served_document_describes_the_served_routes(tmp_path: Path) -> None:
    keys = tmp_path / "keys"
    keys.write_text(KEY + "\n")

    async def body(env: Env) -> None:
        async with env.http() as http:
            # No key needed, as for /health.
            response = await http.get("/openapi.json")
        assert response.status_code == 200
        doc = response.json()
        assert doc["openapi"] == "3.1.0"
        served = {(m, r.path) for m, r in _routes(env)}
        documented = {(method.upper(), path) for path, ops in doc["paths"].items()
                      for method in ops}
        assert documented == served
        completions = doc["paths"]["/v1/completions"]["post"]
        assert completions["security"] == [{"bearer": []}]
        assert "/openapi.json" in doc["paths"]
        error = doc["components"]["schemas"]["Error"]["properties"]["error"]
        assert error["required"] == ["message", "type", "param", "code"]
        assert "413" in completions["responses"] and "429" in completions["responses"]
        prompt = doc["components"]["schemas"]["CompletionBody"]["properties"]["prompt"]
        assert {"type": "string"} in prompt["anyOf"]
        # schemathesis (the fuzzer that reads it) takes it, every operation included.
        schema = schemathesis.openapi.from_dict(doc)
        operations = [result.ok() for result in schema.get_all_operations()]
        assert len(operations) == len(served)

    serve(body, api_key_file=str(keys))


def _routes(env: Env) -> list[tuple[str, Any]]:
    app = env.frontend._http._server.config.app  # type: ignore[union-attr]
    return [(m, r) for r in app.routes for m in r.methods if m != "HEAD"]


@pytest.mark.timeout(30)
def test_bodies_that_broke_the_parser_are_refused_naming_the_body() -> None:
    async def body(env: Env) -> None:
        async with env.http() as http:
            async def post(raw: bytes, path: str = "/v1/chat/completions") -> Any:
                return await http.post(path, content=raw,
                                       headers={"content-type": "application/json"})

            # Nested past json's own recursion limit: was a RecursionError, a 500.
            assert_openai_error(await post(b"[" * 100_000), 400, "body", "levels deep")
            # Parses, but deeper than a request can hold.
            deep: Any = "x"
            for _ in range(MAX_JSON_DEPTH + 1):
                deep = {"a": deep}
            assert_openai_error(await post(json.dumps(
                {"model": MODEL.name, "messages": USER, "chat_template_kwargs": deep}).encode()),
                400, "body", str(MAX_JSON_DEPTH))
            # A lone surrogate escape parses to a str no proto can hold: was a 500.
            assert_openai_error(await post(
                b'{"model": "%s", "prompt": "a\\ud800b"}' % MODEL.name.encode(),
                "/v1/completions"), 400, "body", "surrogate")
            assert_openai_error(await post(b'{"model": "\xff"}'), 400, "body", "UTF-8")
            assert_openai_error(await post(b'{"model": '), 400, "body", "JSON")
            # A byte-order mark is allowed, as json.loads(bytes) allows it.
            ok = await post(b"\xef\xbb\xbf" + json.dumps(
                {"model": MODEL.name, "messages": USER, "max_tokens": 2}).encode())
            assert ok.status_code == 200, ok.text

    serve(body)


@pytest.mark.parametrize("field", ["http_header_timeout_s", "http_body_timeout_s",
                                   "http_write_timeout_s", "http_keep_alive_s"])
def test_http_timeouts_must_be_positive(field: str) -> None:
    with pytest.raises(ValueError, match=field):
        FrontendConfig(**{field: 0})
    with pytest.raises(ValueError, match=field):
        FrontendConfig(**{field: float("inf")})


def test_http_limits_come_from_the_flags() -> None:
    limits = http_limits(FrontendConfig(http_header_timeout_s=2, http_body_timeout_s=3,
                                        http_write_timeout_s=4, http_keep_alive_s=5,
                                        http_max_connections=6))
    assert limits == HttpLimits(2, 3, 4, 6, 5)
    with pytest.raises(ValueError, match="http_max_connections"):
        FrontendConfig(http_max_connections=0)
