"""A port that is already taken: the shared bind code names it and its holder, and a
standalone `corestream frontend` or `corestream coordinator` says so in one line and
exits with CONFIG_ERROR_EXIT, no traceback."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from collections.abc import Iterator
from concurrent import futures
from pathlib import Path

import grpc
import pytest

from services.common.config import CONFIG_ERROR_EXIT
from services.common.grpc_server import bind
from services.common.ports import PortUnavailable
from services.common.security_config import SecurityConfig

ROOT = Path(__file__).parents[3]
TIMEOUT_S = 120


@pytest.fixture
def busy() -> Iterator[int]:
    """A port this test process listens on."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        yield int(sock.getsockname()[1])


def test_bind_names_the_port_its_holder_and_the_flag(busy: int) -> None:
    server = grpc.server(futures.ThreadPoolExecutor(1))
    with pytest.raises(PortUnavailable) as refused:
        bind(server, f"127.0.0.1:{busy}", SecurityConfig(), "--health-port")
    message = str(refused.value)
    assert message.startswith(f"port {busy} is in use by pid {os.getpid()} (")
    assert message.endswith("; pass --health-port to listen on another")
    assert bind(server, "127.0.0.1:0", SecurityConfig()) > 0


def _argv(command: str, flag: str, port: int) -> list[str]:
    flags = {"--port": "0", flag: str(port)}
    if command == "frontend":
        # Nothing listens at the engine address: the start stops before routing.
        flags["--engines"] = "127.0.0.1:1"
    return [command, *(part for item in flags.items() for part in item)]


@pytest.mark.timeout(TIMEOUT_S + 30)
@pytest.mark.parametrize(("command", "flag"), [
    ("frontend", "--port"),
    ("frontend", "--http-port"),
    ("frontend", "--metrics-port"),
    ("coordinator", "--port"),
    ("coordinator", "--metrics-port"),
])
def test_a_command_on_a_busy_port_says_so_in_one_line_and_exits_2(
    busy: int, command: str, flag: str
) -> None:
    result = subprocess.run(
        [sys.executable, "-m", "services.cli.main", *_argv(command, flag, busy)],
        cwd=ROOT, capture_output=True, text=True, timeout=TIMEOUT_S,
        env={**os.environ, "PYTHONUNBUFFERED": "1"})
    output = result.stdout + result.stderr
    assert result.returncode == CONFIG_ERROR_EXIT, output
    assert "Traceback" not in output, output
    [line] = [line for line in output.splitlines() if "in use" in line]
    assert line.startswith(f"corestream {command}: port {busy} is in use by pid "
                           f"{os.getpid()} ("), output
    assert line.endswith(f"; pass {flag} to listen on another"), output
