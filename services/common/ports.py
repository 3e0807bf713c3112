"""Free TCP ports for processes that rendezvous on one host."""

from __future__ import annotations

import socket


def free_port(host: str = "127.0.0.1") -> int:
    """A port free on `host` now (another process may still take it before it is bound)."""
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])
