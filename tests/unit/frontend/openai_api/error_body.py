"""The check every HTTP-door test makes of an error answer: the status, and OpenAI's error
body (`{"error": {"message", "type", "param", "code"}}`) naming the field and the words."""

from __future__ import annotations

from typing import Any


def assert_openai_error(response: Any, status: int, param: str | None,
                        *words: str) -> dict[str, Any]:
    """`response`: an httpx (or Starlette test client) response. Returns the error."""
    assert response.status_code == status, response.text
    body = response.json()
    assert set(body) == {"error"}
    error = body["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert isinstance(error["message"], str) and isinstance(error["type"], str)
    assert error["param"] == param, error
    for word in words:
        assert word in error["message"], error
    return error
