"""Iteration details: what each busy-loop step did, for whoever asked.

A step's details say which work it ran (requests and tokens, split into prefills and
decodes), where it ran in a lockstep wave, and how long its phases took: schedule,
forward, sample (both measured by the model runner; the one-call greedy decode samples
inside its forward, so its sample time is 0) and update (the scheduler's update and the
routing of the outputs).

They are recorded only when somebody wants them, so that they cost nothing otherwise:
the engine's `--iteration-details` flag (histograms in the engine's metrics and the
latest steps in `get_stats`, hence `corestream admin stats`), or a Session that asked in
its hello (each step's details then follow that step's outputs on the Session). Steps
with nothing scheduled (a wave's dummy batches) have none.

Plain Python, no torch: the loop thread is its only writer.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

from services.engine.scheduler.output import RunnerOutput, SchedulerOutput

RECENT_STEPS = 16
"""Details of the latest steps that `get_stats` shows."""


@dataclass(frozen=True, slots=True)
class IterationDetails:
    step: int
    """The engine's step counter (the scheduler's) for this step."""
    started_at: float
    """Seconds since the epoch when the step began to schedule."""
    num_requests: int
    num_tokens: int
    num_prefill_requests: int
    """Requests fed prompt tokens (a chunk of their prefill, or a recompute after a
    preemption); the others decoded one token each (and their draft tokens)."""
    num_prefill_tokens: int
    num_decode_requests: int
    schedule_s: float
    forward_s: float
    sample_s: float
    update_s: float
    wave: int | None = None
    """The lockstep wave the step ran in (an expert-parallel rank), and its index there
    (0 for a wave's first step)."""
    wave_step: int | None = None


@dataclass(frozen=True, slots=True)
class StepClock:
    """When a step's schedule began and how long it took (kept until its update)."""

    started_at: float
    schedule_s: float


class IterationRecorder:
    def __init__(self, always: bool, sessions_asked: Callable[[], bool]) -> None:
        """`always`: record every step (the engine's flag); else only while
        `sessions_asked()` (an open Session asked for them)."""
        self._always = always
        self._sessions_asked = sessions_asked
        self.recent: deque[IterationDetails] = deque(maxlen=RECENT_STEPS)
        self.num_steps = 0
        self._totals = dict.fromkeys(
            ("num_tokens", "num_prefill_tokens", "schedule_s", "forward_s", "sample_s",
             "update_s"), 0.0)

    @property
    def wanted(self) -> bool:
        return self._always or self._sessions_asked()

    @staticmethod
    def clock() -> float:
        return time.perf_counter()

    def build(self, out: SchedulerOutput, result: RunnerOutput, clock: StepClock,
              update_s: float, wave: tuple[int, int] | None) -> IterationDetails:
        """The details of the step that ran `out` into `result`, counted in the totals."""
        # A decode with draft tokens is still a decode (its drafts are verified).
        prefills = [r for r in out.requests
                    if len(r.token_ids) > 1 + r.num_draft_tokens
                    or r.start_pos < len(r.prompt_token_ids)]
        details = IterationDetails(
            step=out.step,
            started_at=clock.started_at,
            num_requests=len(out.requests),
            num_tokens=out.num_tokens,
            num_prefill_requests=len(prefills),
            num_prefill_tokens=sum(len(r.token_ids) for r in prefills),
            num_decode_requests=len(out.requests) - len(prefills),
            schedule_s=clock.schedule_s,
            forward_s=result.forward_s,
            sample_s=result.sample_s,
            update_s=update_s,
            wave=wave[0] if wave else None,
            wave_step=wave[1] if wave else None,
        )
        self.recent.append(details)
        self.num_steps += 1
        for key in self._totals:
            self._totals[key] += getattr(details, key)
        return details

    def summary(self) -> dict[str, Any]:
        """For `get_stats`: totals over every recorded step and the latest steps."""
        return {"steps": self.num_steps, "totals": dict(self._totals),
                "recent": [asdict(d) for d in self.recent]}
