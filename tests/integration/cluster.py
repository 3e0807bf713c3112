"""Start and stop a real `corestream serve` cluster for tests."""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

from corestream.generate.v1 import admin_service_pb2 as admin_pb2

from services.common.ports import free_port

REPO = Path(__file__).resolve().parents[2]


def descendants(pid: int) -> set[int]:
    """Every live process below `pid`, from /proc."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        children.setdefault(ppid, []).append(int(entry.name))
    found: set[int] = set()
    todo = [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            if child not in found:
                found.add(child)
                todo.append(child)
    return found


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


class Cluster:
    """`corestream serve` in a subprocess; its output is kept for failure messages."""

    def __init__(self, extra_args: Sequence[str] = (), startup_timeout: float = 180,
                 env: Mapping[str, str] | None = None) -> None:
        self.port = free_port()
        self.address = f"127.0.0.1:{self.port}"
        # serve's metrics port is fixed by default: off here, since tests may run
        # clusters side by side (a test's own --metrics-port comes later and wins). The
        # engines' oneDNN warm-up too (~1 s an engine, 3 minutes of the suite): the
        # kernel tests and the soak (`--onednn-warmup`) test it.
        cmd = [sys.executable, "-m", "services.cli", "serve", "--port", str(self.port),
               "--metrics-port", "0", "--no-onednn-warmup", *extra_args]
        self.proc = subprocess.Popen(
            cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
            env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})},
        )
        self.lines: list[str] = []
        self._ready = threading.Event()
        threading.Thread(target=self._read, daemon=True).start()
        deadline = time.monotonic() + startup_timeout
        while not self._ready.wait(0.2):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError("serve did not start:\n" + self.output())

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.append(line)
            if "corestream is serving on" in line:
                self._ready.set()

    def engine_pid(self, index: int) -> int:
        """The pid of engine `index` (the process started with --engine-index index)."""
        for pid in descendants(self.proc.pid):
            try:
                argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
            except OSError:
                continue
            flag = b"--engine-index"
            if flag in argv and argv[argv.index(flag) + 1] == str(index).encode():
                return pid
        raise LookupError(f"no engine {index} below serve:\n{self.output()}")

    def logged_addresses(self, pattern: str) -> list[str]:
        """host:port values the children logged with `pattern` (a regex with one group)."""
        return [m.group(1) for line in self.lines if (m := re.search(pattern, line))]

    @property
    def coordinator_address(self) -> str:
        return self.logged_addresses(r"coordinator listening on (\S+)")[0]

    @property
    def engine_addresses(self) -> list[str]:
        return self.logged_addresses(r"engine \d+ listening on (\S+)")

    def output(self) -> str:
        return "".join(self.lines[-200:])

    def stop(self, sig: int = signal.SIGINT, timeout: float = 60) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                for pid in descendants(self.proc.pid):
                    os.kill(pid, signal.SIGKILL)
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode


@contextlib.contextmanager
def frozen(admin: Any, entered: bool = True) -> Iterator[Callable[[], None]]:
    """The engines' scheduling paused through `admin` (an AdminServiceStub), requests
    kept where they are and aborts still applied: from entry, or from the first call of
    what it yields; resumed on exit. A request frozen so cannot run to its end before a
    test's cancel, deadline or disconnect, however fast the engine steps."""
    paused = False

    def freeze() -> None:
        nonlocal paused
        if not paused:
            admin.PauseScheduling(
                admin_pb2.PauseSchedulingRequest(mode=admin_pb2.PAUSE_MODE_KEEP), timeout=20)
            paused = True

    if entered:
        freeze()
    try:
        yield freeze
    finally:
        if paused:
            admin.ResumeScheduling(admin_pb2.ResumeSchedulingRequest(), timeout=20)


@contextlib.contextmanager
def frozen_running(admin: Any, start: Callable[[], Iterator[Any]],
                   tries: int = 5) -> Iterator[Iterator[Any]]:
    """A stream that `start` opens (its first chunk read), frozen by a keep pause whose
    own answer shows a request running; resumed on exit. The tiny model makes 1500 tokens
    in about half a second, so a stream may end before the pause reaches its engine: then
    another one starts."""
    for _ in range(tries):
        stream = start()
        next(stream)
        kept = admin.PauseScheduling(
            admin_pb2.PauseSchedulingRequest(mode=admin_pb2.PAUSE_MODE_KEEP), timeout=20)
        if any(r.ok and json.loads(r.result_json)["num_running"] > 0 for r in kept.results):
            try:
                yield stream
            finally:
                admin.ResumeScheduling(admin_pb2.ResumeSchedulingRequest(), timeout=20)
            return
        admin.ResumeScheduling(admin_pb2.ResumeSchedulingRequest(), timeout=20)
        # A gRPC stream cancels, an HTTP one (OpenAI's client) closes.
        (getattr(stream, "cancel", None) or stream.close)()  # type: ignore[attr-defined]
    raise AssertionError(f"no keep pause found a request running in {tries} tries")
