"""The cluster's processes by role, and what each holds (memory, descriptors, threads).

serve restarts what dies, so a role ("engine-0", "frontend") maps to a new pid after a
fault; the soak samples every live process of each role and keeps, per pid, its level
once warm and its last level, to tell a leak from a restart.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from tests.integration.cluster import Cluster, alive, descendants

PAGE = os.sysconf("SC_PAGE_SIZE")


@dataclass(frozen=True)
class Usage:
    rss_bytes: int
    fds: int
    threads: int


@dataclass(frozen=True)
class ProcessRecord:
    role: str
    pid: int
    warm: Usage
    last: Usage
    lived_s: float
    """From the warm sample to the last one."""
    ended: bool = False
    """Gone before the end (a fault killed it, or its engine): judged by its last sample,
    since a process that grows and is then killed would otherwise never be judged."""


def _argv(pid: int) -> list[bytes]:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except OSError:
        return []


def roles(cluster: Cluster) -> dict[str, int]:
    """Each live child of serve by role: coordinator, frontend, engine-N, and
    engine-N-worker-K for tensor-parallel workers (K in pid order)."""
    found: dict[str, int] = {}
    workers: dict[int, list[int]] = {}
    for pid in sorted(descendants(cluster.proc.pid)):
        argv = _argv(pid)
        if not alive(pid) or len(argv) < 4:
            continue
        if b"--engine-index" in argv and argv[3] == b"engine":
            found[f"engine-{argv[argv.index(b'--engine-index') + 1].decode()}"] = pid
        elif argv[3] in (b"coordinator", b"frontend"):
            found[argv[3].decode()] = pid
        elif any(b"spawn_main" in a for a in argv):
            workers.setdefault(_parent(pid), []).append(pid)
    for role, pid in list(found.items()):
        for k, worker in enumerate(sorted(workers.get(pid, ()))):
            found[f"{role}-worker-{k}"] = worker
    return found


def _parent(pid: int) -> int:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return -1
    return int(stat.rsplit(")", 1)[1].split()[1])


def usage(pid: int) -> Usage | None:
    try:
        rss_pages = int(Path(f"/proc/{pid}/statm").read_text().split()[1])
        fds = len(os.listdir(f"/proc/{pid}/fd"))
        threads = len(os.listdir(f"/proc/{pid}/task"))
    except (OSError, IndexError, ValueError):
        return None
    return Usage(rss_pages * PAGE, fds, threads)


class UsageSampler:
    """Samples every process of the cluster every `every_s` seconds on a thread of its own;
    keeps each pid's warm usage and its last, and logs the levels now and then."""

    def __init__(self, cluster: Cluster, log: Callable[[str], None], log_every_s: float,
                 every_s: float = 2.0) -> None:
        self._cluster = cluster
        self._log = log
        self._log_every_s = log_every_s
        self._every_s = every_s
        self._logged = time.monotonic()
        self.warm: dict[int, tuple[str, Usage, float]] = {}
        self.last: dict[int, tuple[str, Usage, float]] = {}
        self._warm_after: float | None = None
        self._settle_s = 0.0
        self._born: dict[int, float] = {}
        self._heals: list[float] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="soak-sampler", daemon=True)
        self._thread.start()

    def warm_from(self, at: float, settle_s: float) -> None:
        """Pids seen before `at` are warm at `at`; later ones (restarted) `settle_s`
        after the cluster next served again (`healed`): a process that is still
        loading is not warm."""
        self._warm_after = at
        self._settle_s = settle_s

    def healed(self, at: float) -> None:
        """The cluster served again at `at` (every process back and answering)."""
        self._heals.append(at)

    def sample(self) -> None:
        now = time.monotonic()
        for role, pid in roles(self._cluster).items():
            u = usage(pid)
            if u is None:
                continue
            born = self._born.setdefault(pid, now)
            self.last[pid] = (role, u, now)
            if pid in self.warm or self._warm_after is None or now < self._warm_after:
                continue
            if born < self._warm_after or any(
                    born <= h <= now - self._settle_s for h in self._heals):
                self.warm[pid] = (role, u, now)

    def records(self) -> list[ProcessRecord]:
        """Each process that had a warm level, live or gone since: that level, its last,
        how long between."""
        live = set(roles(self._cluster).values())
        return [ProcessRecord(role, pid, warm, self.last[pid][1], self.last[pid][2] - at,
                              ended=pid not in live)
                for pid, (role, warm, at) in sorted(self.warm.items(),
                                                    key=lambda x: (x[1][0], x[1][2]))]

    @property
    def running(self) -> bool:
        """Sampling still (not ended by an error in its thread)."""
        return self._thread.is_alive()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        while not self._stop.wait(self._every_s):
            self.sample()
            if time.monotonic() - self._logged >= self._log_every_s:
                self._logged = time.monotonic()
                recent = sorted((v for v in self.last.values() if v[2] >= self._logged - 5),
                                key=lambda v: v[0])
                self._log("  usage: " + ", ".join(
                    f"{role} {u.rss_bytes / 2**20:.0f} MiB/{u.fds} fds/{u.threads} thr"
                    for role, u, _ in recent))
