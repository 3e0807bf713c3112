"""The cluster's processes by role, and what each holds (memory, descriptors, threads).

serve restarts what dies, so a role ("engine-0", "frontend") maps to a new pid after a
fault; the soak samples every live process of each role and keeps, per pid, its level
once warm and its last level, to tell a leak from a restart.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from tests.integration.cluster import Cluster, alive, descendants

PAGE = os.sysconf("SC_PAGE_SIZE")


@dataclass(frozen=True)
class Usage:
    rss_bytes: int
    fds: int
    threads: int


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
