"""The restart policy of `corestream serve`: whether and when to restart a part of the
cluster that exited without being asked to, and when to give up on it.

A part is what serve restarts as one: the coordinator, the frontend, one dense
engine, or a whole MoE expert-parallel group (its ranks share collectives, so one
rank cannot rejoin the others alone). Each unrequested exit waits an exponential
backoff (INITIAL_BACKOFF_S doubling per exit within the window, up to the cap)
before the restart; more than `max_restarts` exits within `window_s` is a crash loop,
and the part is given up. A part that ran longer than the window starts over at the
initial backoff, so one crash a day never adds up to a give-up.

Pure bookkeeping with an injectable clock: services/serve/supervision.py owns the processes.
"""

from __future__ import annotations

import signal
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

INITIAL_BACKOFF_S = 0.5


@dataclass(frozen=True)
class RestartPolicy:
    max_restarts: int
    """Restarts allowed within `window_s`; one more exit gives up (0: never restart)."""
    window_s: float
    backoff_max_s: float
    backoff_initial_s: float = INITIAL_BACKOFF_S

    def __post_init__(self) -> None:
        if self.max_restarts < 0:
            raise ValueError(f"max_restarts must be >= 0, got {self.max_restarts}")
        if self.window_s <= 0:
            raise ValueError(f"window_s must be > 0, got {self.window_s}")
        if not 0 < self.backoff_initial_s <= self.backoff_max_s:
            raise ValueError(f"backoff must satisfy 0 < initial ({self.backoff_initial_s}) "
                             f"<= max ({self.backoff_max_s})")


def describe_exit(returncode: int) -> str:
    """An exit status as a person reads it: `code 1`, `code -9 (SIGKILL)`."""
    if returncode >= 0:
        return f"code {returncode}"
    try:
        return f"code {returncode} ({signal.Signals(-returncode).name})"
    except ValueError:
        return f"code {returncode} (signal {-returncode})"


@dataclass
class RestartTracker:
    """The restart history of one part."""

    part: str
    policy: RestartPolicy
    clock: Callable[[], float] = time.monotonic
    restarts: int = 0
    last_exit: str = ""
    given_up: bool = False
    _exits: deque[float] = field(default_factory=deque, repr=False)

    @property
    def recent_exits(self) -> int:
        return len(self._exits)

    def give_up(self, cause: str) -> None:
        """Record an exit that no restart would cure."""
        self.last_exit = cause
        self.given_up = True

    def on_exit(self, cause: str) -> float | None:
        """Record an unrequested exit (`cause` from describe_exit); the seconds to wait
        before restarting, or None: a crash loop, give the part up."""
        now = self.clock()
        self.last_exit = cause
        self._exits.append(now)
        while now - self._exits[0] > self.policy.window_s:
            self._exits.popleft()
        if self.given_up or len(self._exits) > self.policy.max_restarts:
            self.given_up = True
            return None
        self.restarts += 1
        delay = self.policy.backoff_initial_s * 2 ** (len(self._exits) - 1)
        return min(delay, self.policy.backoff_max_s)
