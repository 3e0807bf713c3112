"""How often `corestream serve` restarted each of its processes, as a small JSON file.

serve writes it on every change (a new file renamed into place, so a reader never
sees half of one); the frontend, started with --restart-status-file, reads it for
AdminService/GetEngineStats. A file and not an RPC because the frontend is one of
the processes serve restarts: the record must outlive it.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable
from dataclasses import asdict, dataclass
from pathlib import Path


@dataclass(frozen=True)
class PartStatus:
    part: str
    """"coordinator", "frontend", "engine-N", or "engines" (an MoE group)."""
    restarts: int = 0
    last_exit: str = ""
    """Why it last exited ("code 1", "code -9 (SIGKILL)"); empty when it never did."""
    given_up: bool = False
    """A crash loop: serve no longer restarts it."""

    @property
    def engine_given_up(self) -> bool:
        """One engine of a cluster that serves on without it. (Serve stops the cluster
        when it gives up anything else, an MoE group included.)"""
        return self.given_up and self.part.startswith("engine-")


def write_status(path: Path, parts: Iterable[PartStatus]) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps([asdict(p) for p in parts]))
    os.replace(tmp, path)


def read_status(path: Path) -> list[PartStatus]:
    """The parts in the file; none when there is no file (not started by serve)."""
    try:
        entries = json.loads(path.read_text())
    except FileNotFoundError:
        return []
    return [PartStatus(**entry) for entry in entries]


def given_up_engines(path: str) -> list[str]:
    """The engine parts serve gave up on, per the file at `path` ('' when not under serve)."""
    if not path:
        return []
    return [p.part for p in read_status(Path(path)) if p.engine_given_up]
