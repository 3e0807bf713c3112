"""Exponential backoff with jitter for reconnect loops."""

from __future__ import annotations

import random


class Backoff:
    def __init__(self, initial_s: float = 0.1, max_s: float = 5.0) -> None:
        self._initial_s = initial_s
        self._max_s = max_s
        self._next_s = initial_s

    def reset(self) -> None:
        self._next_s = self._initial_s

    def next_delay(self) -> float:
        """The next wait; jittered by +-20% so that many frontends do not reconnect in step."""
        delay = self._next_s * random.uniform(0.8, 1.2)
        self._next_s = min(self._next_s * 2, self._max_s)
        return delay
