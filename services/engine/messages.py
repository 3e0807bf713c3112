"""What other threads put on EngineCore's input queue: each item is `(InputType, payload)`.

The busy loop takes the items between steps, in order, so a request, an abort and
a utility call apply in the order they arrived.
"""

from __future__ import annotations

import enum
import queue
from typing import Any, TypeAlias


class InputType(enum.Enum):
    ADD = enum.auto()
    ABORT = enum.auto()
    WAKEUP = enum.auto()
    SHUTDOWN = enum.auto()
    UTILITY = enum.auto()
    START_WAVE = enum.auto()
    GRAMMAR_READY = enum.auto()
    KV_SUBSCRIBE = enum.auto()


InputQueue: TypeAlias = queue.SimpleQueue[tuple[InputType, Any]]
