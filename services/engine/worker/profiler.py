"""The profile utility's torch profiler: start on demand, stop to a Chrome trace.

Operators ask for a profile of a live engine (`corestream admin profile-start`,
then `profile-stop`) rather than restarting it under a profiler; the trace lands
in the engine's profile folder and the reply names it with the busiest operators,
so a first look needs no trace viewer.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

import torch
from torch.profiler import ProfilerActivity, profile

TOP_OPERATORS = 10


class Profiler:
    def __init__(self, folder: Path, name: str) -> None:
        self._folder = folder
        self._name = name
        self._profile: profile | None = None
        self._started = 0.0

    @property
    def running(self) -> bool:
        return self._profile is not None

    def start(self) -> dict[str, Any]:
        if self._profile is not None:
            raise ValueError("a profile is already running; stop it first")
        activities = [ProfilerActivity.CPU]
        if torch.cuda.is_available():
            activities.append(ProfilerActivity.CUDA)
        self._folder.mkdir(parents=True, exist_ok=True)  # fail now, not at stop
        prof = profile(activities=activities)
        prof.start()
        self._profile, self._started = prof, time.monotonic()
        return {"profiling": True, "folder": str(self._folder)}

    def stop(self) -> dict[str, Any]:
        prof = self._profile
        if prof is None:
            raise ValueError("no profile is running; start one first")
        self._profile = None
        prof.stop()
        stamp = time.strftime("%Y%m%d-%H%M%S")
        path = self._folder / f"{self._name}-{stamp}-{os.getpid()}.json"
        prof.export_chrome_trace(str(path))
        by_self_time = sorted(prof.key_averages(), key=lambda e: e.self_cpu_time_total,
                              reverse=True)
        return {
            "trace": str(path),
            "seconds": round(time.monotonic() - self._started, 3),
            "top_operators": [
                {"name": e.key, "calls": e.count,
                 "self_cpu_ms": round(e.self_cpu_time_total / 1000, 3)}
                for e in by_self_time[:TOP_OPERATORS]
            ],
        }
