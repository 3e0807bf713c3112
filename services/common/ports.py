"""Free TCP ports for processes that rendezvous on one host, and who holds a busy one."""

from __future__ import annotations

import errno
import fcntl
import json
import os
import random
import socket
import tempfile
import threading
import time
from pathlib import Path
from typing import IO


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


_LOWEST = 10000
_HELD_S = 120.0  # how long a port handed out stays promised to whoever asked for it
_issued_lock = threading.Lock()


def free_port(host: str = "127.0.0.1", count: int = 1) -> int:
    """A port free on `host` now, for a process started next to listen on (with
    `count`, the first of that many consecutive ones, all free and all promised: a group
    whose rank r listens on port + r).

    It is drawn below the kernel's ephemeral range where that leaves room: a port the
    kernel hands out for a bind to port 0 (gloo's pair sockets, a client's connection,
    another server) comes from that range, so in it a port chosen here and bound a moment
    later by a child is taken from under it now and then. Below it, the only rival is
    another process choosing the same number, and a ledger shared by this user's
    processes on the host (a locked file in the temp folder) keeps two from doing so
    within two minutes of each other."""
    low, _ = _ephemeral_range()
    if low - _LOWEST < 4096:
        return _kernel_port(host)
    rng = random.SystemRandom()
    with _issued_lock, _Ledger() as promised:
        for _ in range(64):
            port = rng.randrange(_LOWEST, low - count + 1)
            block = range(port, port + count)
            if all(p not in promised and _bindable(host, p) for p in block):
                promised.update(dict.fromkeys(block, time.time()))
                return port
    return _kernel_port(host)


class _Ledger:
    """Ports handed out lately by any process of this user, under an exclusive lock."""

    def __init__(self) -> None:
        self._path = Path(tempfile.gettempdir()) / f"corestream-ports-{os.getuid()}.json"
        self._file: IO[str] | None = None
        self._ports: dict[int, float] = {}

    def __enter__(self) -> dict[int, float]:
        try:
            self._file = open(self._path, "a+")  # noqa: SIM115 (closed in __exit__)
            fcntl.flock(self._file, fcntl.LOCK_EX)
            self._file.seek(0)
            now = time.time()
            self._ports = {int(p): t for p, t in json.loads(self._file.read() or "{}").items()
                           if now - t < _HELD_S}
        except (OSError, ValueError):
            self._ports = {}  # no ledger (a read-only temp folder, a torn file): chance only
        return self._ports

    def __exit__(self, *_: object) -> None:
        if self._file is None:
            return
        try:
            self._file.seek(0)
            self._file.truncate()
            self._file.write(json.dumps(self._ports))
            self._file.flush()
        except OSError:
            pass
        finally:
            self._file.close()  # releases the lock


def _kernel_port(host: str) -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def _ephemeral_range() -> tuple[int, int]:
    try:
        low, high = Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()
        return int(low), int(high)
    except (OSError, ValueError):
        return 32768, 60999  # Linux's default


def _bindable(host: str, port: int) -> bool:
    # Without SO_REUSEADDR: a port in TIME_WAIT counts as taken, the safe side.
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as s:
        try:
            s.bind((host, port))
        except OSError:
            return False
    return True


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
