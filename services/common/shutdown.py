"""SIGTERM / SIGINT as a request to shut down, never an abrupt exit."""

from __future__ import annotations

import signal
import threading
from types import FrameType


class ShutdownSignal:
    """An event set by the first SIGTERM or SIGINT; call install() from the main thread."""

    def __init__(self) -> None:
        self._event = threading.Event()

    @classmethod
    def install(cls) -> ShutdownSignal:
        sig = cls()
        signal.signal(signal.SIGTERM, sig._handle)
        signal.signal(signal.SIGINT, sig._handle)
        return sig

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        self._event.set()

    def wait(self, timeout: float | None = None) -> bool:
        # Event.wait with no timeout is not interruptible on every platform: poll.
        while not self._event.wait(0.5 if timeout is None else timeout):
            if timeout is not None:
                return False
        return True

    def is_set(self) -> bool:
        return self._event.is_set()

    def set(self) -> None:
        self._event.set()
