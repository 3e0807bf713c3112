"""Raw HTTP abuse against the HTTP door of a real cluster: broken bodies, bodies past
the limit, slow headers and bodies (slowloris), many idle connections, and an SSE
reader that stops reading.

Each abuse runs while another client's ordinary request must still succeed promptly
(`_served_promptly`), and the frontend's memory must stay bounded where the abuse
could make it grow. The door runs with short limits (header and body timeouts of 1 s,
write timeout 2 s, 48 connections) so that every timeout is waited for, never slept
past: each check waits for the server's own answer or close.
"""

from __future__ import annotations

import json
import socket
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from services.common.ports import free_port
from tests.integration.cluster import Cluster, descendants
from tests.unit.frontend.openai_api.error_body import assert_openai_error

HEADER_TIMEOUT_S = 1.0
BODY_TIMEOUT_S = 1.0
WRITE_TIMEOUT_S = 2.0
MAX_CONNECTIONS = 48
MAX_MESSAGE_BYTES = 65536
PROMPT_S = 10.0
"""An ordinary request must be answered within this, abuse or not (CI cores are busy)."""

pytestmark = pytest.mark.timeout(300)


class Door:
    def __init__(self) -> None:
        self.port = free_port()
        self.cluster = Cluster([
            "--engines", "1", "--http-port", str(self.port),
            "--max-tokens-limit", "2000", "--max-n", "16",
            "--max-message-bytes", str(MAX_MESSAGE_BYTES),
            "--http-header-timeout-s", str(HEADER_TIMEOUT_S),
            "--http-body-timeout-s", str(BODY_TIMEOUT_S),
            "--http-write-timeout-s", str(WRITE_TIMEOUT_S),
            "--http-max-connections", str(MAX_CONNECTIONS)])
        self.base = f"http://127.0.0.1:{self.port}"
        self.model = httpx.get(f"{self.base}/v1/models", timeout=30).json()["data"][0]["id"]
        self.frontend = frontend_pid(self.cluster)

    def connect(self, rcvbuf: int | None = None) -> socket.socket:
        sock = socket.socket()
        if rcvbuf is not None:
            # Before connecting, so that the window the server sees stays small.
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
        sock.connect(("127.0.0.1", self.port))
        sock.settimeout(30)
        return sock

    def post(self, path: str, content: bytes, **headers: str) -> httpx.Response:
        return httpx.post(self.base + path, content=content, timeout=30,
                          headers={"content-type": "application/json", **headers})


@pytest.fixture(scope="module")
def door() -> Iterator[Door]:
    door = Door()
    yield door
    door.cluster.stop()


def frontend_pid(cluster: Cluster) -> int:
    for pid in descendants(cluster.proc.pid):
        if b"frontend" in Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0"):
            return pid
    raise LookupError(f"no frontend below serve:\n{cluster.output()}")


def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise LookupError(pid)


def _served_promptly(door: Door) -> None:
    """Another client's ordinary completion, within PROMPT_S."""
    started = time.monotonic()
    response = httpx.post(f"{door.base}/v1/completions", timeout=PROMPT_S, json={
        "model": door.model, "prompt": "hello", "max_tokens": 2, "temperature": 0})
    assert response.status_code == 200, response.text
    assert time.monotonic() - started < PROMPT_S


def _read_until_closed(sock: socket.socket) -> bytes:
    """Everything the server sends until it closes (a reset counts as a close)."""
    data = b""
    try:
        while chunk := sock.recv(65536):
            data += chunk
    except ConnectionResetError:
        pass
    return data


def _raw_json(data: bytes) -> Any:
    return json.loads(data.split(b"\r\n\r\n", 1)[1])


def test_broken_bodies_are_400s_naming_the_body(door: Door) -> None:
    chat = "/v1/chat/completions"
    assert_openai_error(door.post(chat, b'{"model": '), 400, "body", "not valid JSON")
    assert_openai_error(door.post(chat, b'{"model": "\xff\xfe"}'), 400, "body", "not UTF-8")
    assert_openai_error(door.post(chat, b'{"model": "a\\udc00"}'), 400, "body", "surrogate")
    assert_openai_error(door.post(chat, b"[" * 30_000 + b"]" * 30_000), 400, "body", "levels deep")
    assert_openai_error(door.post(chat, b"[]"), 400, None, "valid dictionary")
    assert_openai_error(door.post(chat, b""), 400, "body", "not valid JSON")
    # The body is read as JSON whatever its content type says (curl -d sends form
    # encoding): JSON is served, anything else is a 400 naming the body.
    good = json.dumps({"model": door.model, "prompt": "hi", "max_tokens": 1}).encode()
    for content_type in ("text/plain", "application/x-www-form-urlencoded", ""):
        assert door.post("/v1/completions", good,
                         **{"content-type": content_type}).status_code == 200
        assert_openai_error(door.post("/v1/completions", b"prompt=hi",
                                      **{"content-type": content_type}),
                            400, "body", "not valid JSON")
    _served_promptly(door)


def test_bodies_past_the_limit_are_413s_naming_it(door: Door) -> None:
    big = b'{"prompt": "' + b"a" * MAX_MESSAGE_BYTES + b'"}'
    assert_openai_error(door.post("/v1/completions", big), 413, "body",
                        str(MAX_MESSAGE_BYTES), "--max-message-bytes")

    # Chunked, no length: refused as soon as the bytes read pass the limit.
    def chunks() -> Iterator[bytes]:
        yield from (b" " * 8192 for _ in range(MAX_MESSAGE_BYTES // 8192 + 2))

    response = httpx.post(f"{door.base}/v1/completions", content=chunks(), timeout=30)
    assert_openai_error(response, 413, "body", str(MAX_MESSAGE_BYTES))

    # A length past the limit is refused before a byte of the body is sent.
    with door.connect() as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nhost: x\r\n"
                     b"content-length: 10000000000\r\n\r\n")
        head = sock.recv(65536)
        assert head.startswith(b"HTTP/1.1 413"), head
    _served_promptly(door)


def test_slow_headers_get_a_408_and_others_are_served(door: Door) -> None:
    with door.connect() as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nhost: x\r\n")
        started = time.monotonic()
        _served_promptly(door)
        # One header byte at a time: the timeout runs from the connection's start.
        sock.settimeout(0.2)
        answer = b""
        while time.monotonic() - started < 30:
            try:
                sock.sendall(b"x")
                answer += sock.recv(65536)
                if answer:
                    break
            except TimeoutError:
                continue
            except (BrokenPipeError, ConnectionResetError):
                break
        sock.settimeout(10)
        answer += _read_until_closed(sock)
        assert answer.startswith(b"HTTP/1.1 408"), answer
        assert "--http-header-timeout-s" in _raw_json(answer)["error"]["message"]
        assert time.monotonic() - started < HEADER_TIMEOUT_S + PROMPT_S


def test_slow_bodies_get_a_408_and_others_are_served(door: Door) -> None:
    with door.connect() as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nhost: x\r\n"
                     b"content-type: application/json\r\ncontent-length: 1000\r\n\r\n{")
        _served_promptly(door)
        # The 408, then the close (the rest of the body will never be read).
        answer = _read_until_closed(sock)
        assert answer.startswith(b"HTTP/1.1 408"), answer
        error = _raw_json(answer)["error"]
        assert error["param"] == "body" and "--http-body-timeout-s" in error["message"]
    # A client that leaves halfway through its body: nobody to answer, and no error
    # logged as the server's (it was a 500 with a traceback, sent to no one).
    with door.connect() as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nhost: x\r\n"
                     b"content-length: 1000\r\n\r\n{")
        _served_promptly(door)
    _served_promptly(door)
    assert "ClientDisconnect" not in door.cluster.output()


def test_idle_connections_are_bounded_and_closed(door: Door) -> None:
    rss_before = rss_mib(door.frontend)
    # Below the cap: idle connections cost nothing to others, and the server closes
    # them once the header timeout passes.
    idle = [door.connect() for _ in range(MAX_CONNECTIONS - 8)]
    _served_promptly(door)
    for sock in idle:
        assert _read_until_closed(sock) == b""  # closed without a word: it sent none
        sock.close()
    # Past the cap: a new connection gets a 503 at once, in OpenAI's shape.
    idle = [door.connect() for _ in range(MAX_CONNECTIONS)]
    with door.connect() as extra:
        answer = _read_until_closed(extra)
    assert answer.startswith(b"HTTP/1.1 503"), answer
    assert _raw_json(answer)["error"]["code"] == "too_many_connections"
    for sock in idle:
        _read_until_closed(sock)
        sock.close()
    _served_promptly(door)
    assert rss_mib(door.frontend) < rss_before + 50


def _running(door: Door) -> int:
    loads = httpx.get(f"{door.base}/v1/loads", timeout=PROMPT_S).json()["loads"]
    return sum(load["num_total_reqs"] for load in loads)


def test_an_sse_reader_that_stops_reading_is_dropped_and_its_request_aborted(
        door: Door) -> None:
    rss_before = rss_mib(door.frontend)
    body = json.dumps({
        "model": door.model, "prompt": "hello", "stream": True, "max_tokens": 2000,
        "n": 16, "ignore_eos": True, "logprobs": 20}).encode()
    # A small receive buffer: the server's writes block after a few hundred kB.
    with door.connect(rcvbuf=4096) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nhost: x\r\n"
                     b"content-type: application/json\r\n"
                     b"content-length: %d\r\n\r\n%s" % (len(body), body))
        assert sock.recv(4096).startswith(b"HTTP/1.1 200")
        # ... and it reads no more. Others are served meanwhile.
        _served_promptly(door)
        # The server drops the connection once its writes stay blocked past the write
        # timeout; the request's engine work is aborted with it, long before its
        # 16 x 2000 tokens could be done.
        deadline = time.monotonic() + 120
        while _running(door) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert _running(door) == 0
        # Dropped: what the kernel still holds drains, then the connection ends (a
        # reset, from the server's abort); a timeout here means it is still open.
        sock.settimeout(10)
        _read_until_closed(sock)
    _served_promptly(door)
    assert rss_mib(door.frontend) < rss_before + 100
