"""Server-sent events for the HTTP door's streamed answers (OpenAI's and SGLang's)."""

from __future__ import annotations

import json
from collections.abc import AsyncGenerator, AsyncIterator, Mapping
from typing import Any

from starlette.responses import Response, StreamingResponse

from services.frontend.errors import RequestError
from services.frontend.openai_api.http_errors import error_body, error_response

SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


async def sse_response(events: AsyncIterator[Mapping[str, Any]], request_id: str,
                       names: Mapping[str, str]) -> Response:
    """The events as a stream, after the first one: a request that fails before its
    first token (validation, routing) gets its HTTP status, not a stream with an error.
    `names` turns our field names into the door's in error messages."""
    try:
        first = await anext(events, None)
    except RequestError as e:
        return error_response(e, request_id, names)

    async def body() -> AsyncGenerator[str, None]:
        try:
            if first is not None:
                yield event(first)
            async for data in events:
                yield event(data)
        except RequestError as e:
            # Too late for a status: the error goes in the stream, as OpenAI's does.
            yield event(error_body(e, names)[1])
        finally:
            await events.aclose()  # type: ignore[attr-defined]  (async generators all)
        yield "data: [DONE]\n\n"

    return StreamingResponse(body(), media_type="text/event-stream",
                             headers={**SSE_HEADERS, "X-Request-Id": request_id})


def event(data: Mapping[str, Any]) -> str:
    return f"data: {json.dumps(data, ensure_ascii=False, separators=(',', ':'))}\n\n"
