"""Watchdog: notices a busy loop that stopped making progress while it had work.

The busy loop calls `feed()` on every iteration and `pause()` just before it blocks
waiting for input with nothing to do, so an idle engine never trips it, however
long it idles. A thread of its own checks the time since the last feed; once that
exceeds the timeout while armed it calls `on_expire` once, from that thread (the
loop's thread is the one that is stuck).

A whole-process freeze (SIGSTOP, a paused VM) stops this thread too; the frontend
covers that case by watching each Session's heartbeats. When the process thaws,
the watchdog sees a gap in its own checks and gives the loop a fresh period
instead of blaming it for time during which nothing in the process ran.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

from services.common.thread_names import name_native_thread

logger = logging.getLogger(__name__)

# How often the timeout is checked, as a fraction of it: expiry is noticed at most
# this much late (and never later than MAX_CHECK_S).
CHECK_FRACTION = 0.05
MAX_CHECK_S = 0.5


class Watchdog:
    def __init__(self, timeout_s: float, on_expire: Callable[[float], None]) -> None:
        """`on_expire(seconds_since_last_feed)` is called once, on the watchdog thread."""
        self.timeout_s = timeout_s
        self._on_expire = on_expire
        self._last_feed = time.monotonic()
        self._armed = False
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="engine-watchdog", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()

    def feed(self) -> None:
        # Two plain attribute writes: cheap enough for every loop iteration, and a
        # reader that sees them out of order only delays a trip by one check.
        self._last_feed = time.monotonic()
        self._armed = True

    def pause(self) -> None:
        self._armed = False

    def _run(self) -> None:
        name_native_thread()
        interval = min(MAX_CHECK_S, self.timeout_s * CHECK_FRACTION)
        last_check = time.monotonic()
        while not self._stop.wait(interval):
            now = time.monotonic()
            if now - last_check > self.timeout_s / 2:
                logger.warning("the process did not run for %.1f s (stopped or starved); "
                               "restarting the watchdog period", now - last_check)
                self._last_feed = now
            last_check = now
            silent_s = now - self._last_feed
            if self._armed and silent_s > self.timeout_s:
                self._on_expire(silent_s)
                return
