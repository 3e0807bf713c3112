"""uvicorn's HTTP/1.1 protocol (h11) with the connection limits it lacks.

uvicorn bounds only the time a kept-alive connection sits idle after a response: a
connection that never sends a request, or sends its headers a byte at a time
(slowloris), holds its socket and buffers for ever, and so does a client that stops
reading a response (an SSE reader that went away without closing). Here:

- `header_timeout_s`: a request's headers must be complete within this long of the
  connection opening or of the previous response's end. A connection that sent part
  of a request then gets a 408 and is closed; an idle one is just closed.
- `write_timeout_s`: a response whose writes stay blocked this long (the transport's
  buffer over its high-water mark, the client not reading) is dropped, as a dead
  client: the connection is aborted, the app sees a disconnect, and the request's
  engine work is aborted as for any client that leaves.
- `max_connections`: past this many open connections a new one gets a 503 and is
  closed at once, before it can hold anything.

A slow *body* is bounded where the body is read (json_body.py), so that its 408 is an
ordinary response of the app.
"""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

from services.frontend.openai_api import responses

if TYPE_CHECKING:
    from services.frontend.config import FrontendConfig


@dataclass(frozen=True)
class HttpLimits:
    """The HTTP door's limits (each a `corestream frontend` flag, config.py)."""

    header_timeout_s: float = 10.0
    body_timeout_s: float = 60.0
    write_timeout_s: float = 60.0
    max_connections: int = 4096
    keep_alive_s: float = 5.0
    """uvicorn's keep-alive: an idle connection after a response is closed past it."""


def http_limits(config: FrontendConfig) -> HttpLimits:
    return HttpLimits(header_timeout_s=config.http_header_timeout_s,
                      body_timeout_s=config.http_body_timeout_s,
                      write_timeout_s=config.http_write_timeout_s,
                      max_connections=config.http_max_connections,
                      keep_alive_s=config.http_keep_alive_s)


def raw_response(status: int, reason: str, message: str, code: str) -> bytes:
    """A whole HTTP/1.1 response with an OpenAI-shaped body, for answers written below
    the app (no request cycle to answer through), always closing the connection."""
    kind = "timeout" if status == 408 else "service_unavailable"
    body = json.dumps(responses.error_body(message, kind, None, code)).encode()
    head = (f"HTTP/1.1 {status} {reason}\r\ncontent-type: application/json\r\n"
            f"content-length: {len(body)}\r\nconnection: close\r\n\r\n")
    return head.encode() + body


class GuardedH11Protocol(H11Protocol):
    """H11Protocol with the header timeout, write timeout and connection cap above;
    `limits` is set on a subclass made per server (`protocol_class`)."""

    limits: HttpLimits = HttpLimits()

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._header_timer: asyncio.TimerHandle | None = None
        self._write_timer: asyncio.TimerHandle | None = None
        self._received = False  # bytes of the pending request have arrived

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        if len(self.connections) > self.limits.max_connections:
            transport.write(raw_response(
                503, "Service Unavailable",
                f"too many open connections (at most {self.limits.max_connections}: "
                "--http-max-connections); retry later", "too_many_connections"))
            transport.close()
            return
        self._arm_header_timer()

    def connection_lost(self, exc: Exception | None) -> None:
        self._cancel_timers()
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        self._received = True
        super().data_received(data)
        if self._request_in_flight():
            # Headers are in: the app (and the body timeout) has the request now.
            self._cancel_header_timer()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if not self.transport.is_closing():
            self._received = False
            self._arm_header_timer()

    def pause_writing(self) -> None:
        super().pause_writing()
        if self._write_timer is None:
            self._write_timer = self.loop.call_later(self.limits.write_timeout_s,
                                                     self._write_timed_out)

    def resume_writing(self) -> None:
        super().resume_writing()
        if self._write_timer is not None:
            self._write_timer.cancel()
            self._write_timer = None

    # ---- timers ----------------------------------------------------------------------

    def _request_in_flight(self) -> bool:
        return self.cycle is not None and not self.cycle.response_complete

    def _arm_header_timer(self) -> None:
        self._cancel_header_timer()
        self._header_timer = self.loop.call_later(self.limits.header_timeout_s,
                                                  self._header_timed_out)

    def _cancel_header_timer(self) -> None:
        if self._header_timer is not None:
            self._header_timer.cancel()
            self._header_timer = None

    def _cancel_timers(self) -> None:
        self._cancel_header_timer()
        if self._write_timer is not None:
            self._write_timer.cancel()
            self._write_timer = None

    def _header_timed_out(self) -> None:
        self._header_timer = None
        if self.transport.is_closing() or self._request_in_flight():
            return
        if self._received and self.conn.their_state is h11.IDLE:
            # Part of a request came, not its end: say why before closing.
            self.transport.write(raw_response(
                408, "Request Timeout",
                f"the request headers did not arrive within {self.limits.header_timeout_s:g} s "
                "(--http-header-timeout-s)", "header_timeout"))
        self.transport.close()

    def _write_timed_out(self) -> None:
        self._write_timer = None
        # abort, not close: close would wait for the unread buffer to drain.
        self.transport.abort()


def protocol_class(limits: HttpLimits) -> type[GuardedH11Protocol]:
    """GuardedH11Protocol bound to `limits` (uvicorn builds protocols from a class)."""
    return type("BoundGuardedH11Protocol", (GuardedH11Protocol,), {"limits": limits})
