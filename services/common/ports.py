"""Free TCP ports for processes that rendezvous on one host, and who holds a busy one."""

from __future__ import annotations

import errno
import os
import socket
from pathlib import Path


class PortUnavailable(OSError):
    """A port this process was told to listen on cannot be bound. The message is one
    line for the operator: the port, its holder where /proc shows it, and the flag
    that chooses another (the command exits with CONFIG_ERROR_EXIT on it)."""


def unavailable(host: str, port: int, flag: str, error: OSError | None = None,
                ) -> PortUnavailable:
    """The PortUnavailable of `host:port`, which `flag` set."""
    reason = port_in_use(host, port)
    if reason is None:
        detail = f": {error.strerror or error}" if error is not None else ""
        reason = f"cannot listen on {host}:{port}{detail}"
    return PortUnavailable(f"{reason}; pass {flag} to listen on another")


def free_port(host: str = "127.0.0.1") -> int:
    """A port free on `host` now (another process may still take it before it is bound)."""
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def port_in_use(host: str, port: int) -> str | None:
    """Why `port` cannot be listened on at `host` ("port 50051 is in use by pid 12, a
    python process"), or None when it can. A port bound and released at once, as here,
    is still free for the process that binds it next (SO_REUSEADDR, as gRPC sets it)."""
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError as e:
            if e.errno != errno.EADDRINUSE:
                return f"cannot listen on {host}:{port}: {e.strerror}"
        else:
            return None
    pid = listener_pid(port)
    if pid is None:
        return f"port {port} is in use"
    return f"port {port} is in use by pid {pid} ({_command(pid)})"


def listener_pid(port: int) -> int | None:
    """The process listening on TCP `port`, where /proc shows it (Linux, and only for
    processes of the same user); None otherwise."""
    inodes = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            lines = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            fields = line.split()
            # local_address is HOST:PORT in hex; state 0A is LISTEN.
            if len(fields) > 9 and fields[3] == "0A" and int(fields[1].split(":")[1], 16) == port:
                inodes.add(f"socket:[{fields[9]}]")
    if not inodes:
        return None
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            if any(os.readlink(fd) in inodes for fd in (proc / "fd").iterdir()):
                return int(proc.name)
        except OSError:
            continue
    return None


def _command(pid: int) -> str:
    try:
        argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except OSError:
        return "unknown command"
    text = " ".join(a.decode(errors="replace") for a in argv if a)
    text = " ".join(text.split()) or "unknown command"
    return text if len(text) <= 80 else text[:79] + "…"
