"""One log format for every process, so interleaved `serve` output stays readable.

`text` (the default) is for people; `json` writes one object per line for log
pipelines, with the request id and trace id of the request being served where
they are known: the request id from `request_context` (a contextvar, so every
asyncio task and thread sees its own) or a record's `extra={"request_id": ...}`,
the trace and span ids from the current OpenTelemetry span.
"""

from __future__ import annotations

import contextlib
import contextvars
import json
import logging
import sys
from collections.abc import Iterator
from datetime import UTC, datetime
from typing import Any

from opentelemetry import trace

REQUEST_ID: contextvars.ContextVar[str] = contextvars.ContextVar("request_id", default="")


@contextlib.contextmanager
def request_context(request_id: str) -> Iterator[None]:
    """Tag the log records written inside with `request_id`."""
    token = REQUEST_ID.set(request_id)
    try:
        yield
    finally:
        REQUEST_ID.reset(token)


class JsonFormatter(logging.Formatter):
    def __init__(self, service: str) -> None:
        super().__init__()
        self._service = service

    def format(self, record: logging.LogRecord) -> str:
        entry: dict[str, Any] = {
            "time": datetime.fromtimestamp(record.created, UTC).isoformat(timespec="milliseconds"),
            "level": record.levelname,
            "service": self._service,
            "pid": record.process,
            "logger": record.name,
            "message": record.getMessage(),
        }
        request_id = getattr(record, "request_id", "") or REQUEST_ID.get()
        if request_id:
            entry["request_id"] = request_id
        span = trace.get_current_span().get_span_context()
        if span.is_valid:
            entry["trace_id"] = format(span.trace_id, "032x")
            entry["span_id"] = format(span.span_id, "016x")
        if record.exc_info:
            entry["exception"] = self.formatException(record.exc_info)
        if record.stack_info:
            entry["stack"] = self.formatStack(record.stack_info)
        return json.dumps(entry, ensure_ascii=False)


def setup_logging(service: str, level: str = "INFO", log_format: str = "text") -> None:
    if log_format == "json":
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(JsonFormatter(service))
        logging.basicConfig(level=level.upper(), handlers=[handler], force=True)
        return
    logging.basicConfig(
        level=level.upper(),
        stream=sys.stderr,
        format=f"%(asctime)s %(levelname)s {service}[%(process)d] %(name)s: %(message)s",
        force=True,
    )
