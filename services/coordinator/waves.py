"""WaveHub: relays wave starts between the engines of an expert-parallel group.

An MoE model's ranks step in lockstep waves (services/engine/waves/state.py). A rank that
gets work while the group idles starts the next wave itself and tells the
coordinator, which relays the start to every other rank of the same group (the
engines serving the same model). Engines are the judges of staleness: one that has
already finished the announced wave ignores the start, so the hub relays every
announcement rather than second-guessing the race. It remembers the latest
announcement of each group so that a rank subscribing late (still starting) learns
of a wave that began without it.
"""

from __future__ import annotations

import queue
import threading
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class WaveStart:
    wave: int
    started_by: int
    """The engine index that announced it."""


class WaveHub:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        # group -> engine index -> that subscriber's queue (None ends its stream)
        self._subscribers: dict[str, dict[int, queue.Queue[WaveStart | None]]] = {}
        self._latest: dict[str, WaveStart] = {}

    def announce(self, group: str, start: WaveStart) -> int:
        """Relay `start` to the group's other subscribers; returns how many got it."""
        with self._lock:
            latest = self._latest.get(group)
            if latest is None or start.wave >= latest.wave:
                self._latest[group] = start
            targets = [q for index, q in self._subscribers.get(group, {}).items()
                       if index != start.started_by]
        for q in targets:
            q.put(start)
        return len(targets)

    def subscribe(self, group: str, engine_index: int) -> queue.Queue[WaveStart | None]:
        """A queue of the starts other ranks announce from now on, beginning with the
        latest one already announced (a wave may have begun before this rank listened).
        A second subscription of the same rank replaces (and ends) the first."""
        q: queue.Queue[WaveStart | None] = queue.Queue()
        with self._lock:
            old = self._subscribers.setdefault(group, {}).get(engine_index)
            self._subscribers[group][engine_index] = q
            latest = self._latest.get(group)
        if old is not None:
            old.put(None)
        if latest is not None and latest.started_by != engine_index:
            q.put(latest)
        return q

    def unsubscribe(self, group: str, engine_index: int,
                    q: queue.Queue[WaveStart | None]) -> None:
        with self._lock:
            subscribers = self._subscribers.get(group, {})
            if subscribers.get(engine_index) is q:
                del subscribers[engine_index]

    def close(self) -> None:
        """End every stream (the coordinator is stopping)."""
        with self._lock:
            queues = [q for group in self._subscribers.values() for q in group.values()]
            self._subscribers.clear()
        for q in queues:
            q.put(None)
