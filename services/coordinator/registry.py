"""The engine registry: who is serving, where, and how loaded.

Plain Python guarded by one condition variable. Every change bumps
`generation`, which watchers wait on; readers get immutable snapshots.

Each entry holds a lease that every report renews: `expire` drops the engines
silent for longer than the lease (a frozen process keeps its TCP stream open,
so the stream's end alone would never remove it). An expired engine that wakes
up finds its id unknown and registers again.
"""

from __future__ import annotations

import itertools
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace


@dataclass(frozen=True, slots=True)
class EngineEntry:
    engine_id: str
    engine_index: int
    address: str
    model: str
    max_model_len: int
    num_waiting: int = 0
    num_running: int = 0
    kv_cache_usage: float = 0.0
    state: int = 0
    """A common.v1.EngineState value."""
    step_counter: int = 0
    max_num_seqs: int = 0
    """Capacity: the most requests the engine runs at once (0 = not told)."""
    wave: int = 0
    wave_running: bool = False
    """Expert-parallel groups: the engine's wave and whether it runs."""
    tensor_parallel_size: int = 0
    """Ranks the engine's model runs over (0 = not told)."""
    sleep_level: int = 0
    """0 awake; 1 or 2 asleep (alive, queueing requests until woken)."""
    last_report: float = field(default=0.0, compare=False)
    """When the lease was last renewed (the registry's clock)."""


@dataclass(frozen=True, slots=True)
class Snapshot:
    engines: tuple[EngineEntry, ...]
    generation: int


class EngineRegistry:
    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._engines: dict[str, EngineEntry] = {}
        self._generation = 0
        self._ids = itertools.count(1)
        self._changed = threading.Condition()
        self._closed = False

    def register(
        self,
        engine_index: int,
        address: str,
        model: str,
        max_model_len: int,
        state: int,
        max_num_seqs: int = 0,
        tensor_parallel_size: int = 0,
    ) -> str:
        """Add an engine; a re-registration from the same address replaces the old entry."""
        with self._changed:
            for stale in [e.engine_id for e in self._engines.values() if e.address == address]:
                del self._engines[stale]
            engine_id = f"engine-{engine_index}-{next(self._ids)}"
            self._engines[engine_id] = EngineEntry(
                engine_id, engine_index, address, model, max_model_len, state=state,
                max_num_seqs=max_num_seqs, tensor_parallel_size=tensor_parallel_size,
                last_report=self._clock(),
            )
            self._bump()
            return engine_id

    def update(
        self,
        engine_id: str,
        *,
        num_waiting: int,
        num_running: int,
        kv_cache_usage: float,
        state: int,
        step_counter: int,
        wave: int = 0,
        wave_running: bool = False,
        sleep_level: int = 0,
    ) -> bool:
        """Record a load report; False if the engine is not registered."""
        with self._changed:
            entry = self._engines.get(engine_id)
            if entry is None:
                return False
            new = replace(
                entry,
                num_waiting=num_waiting,
                num_running=num_running,
                kv_cache_usage=kv_cache_usage,
                state=state,
                step_counter=step_counter,
                wave=wave,
                wave_running=wave_running,
                sleep_level=sleep_level,
                last_report=self._clock(),
            )
            # Only real changes wake watchers; a heartbeat with equal load does not.
            changed = (new.num_waiting, new.num_running, new.kv_cache_usage, new.state,
                       new.sleep_level) != (
                entry.num_waiting,
                entry.num_running,
                entry.kv_cache_usage,
                entry.state,
                entry.sleep_level,
            )
            self._engines[engine_id] = new
            if changed:
                self._bump()
            return True

    def remove(self, engine_id: str) -> None:
        with self._changed:
            if self._engines.pop(engine_id, None) is not None:
                self._bump()

    def expire(self, lease_s: float) -> list[EngineEntry]:
        """Drop the engines whose last report is older than `lease_s`; returns them."""
        with self._changed:
            deadline = self._clock() - lease_s
            expired = [e for e in self._engines.values() if e.last_report < deadline]
            for entry in expired:
                del self._engines[entry.engine_id]
            if expired:
                self._bump()
            return expired

    def snapshot(self) -> Snapshot:
        with self._changed:
            return self._snapshot()

    def wait_for_change(self, after_generation: int, timeout: float) -> Snapshot:
        """Block until the generation passes `after_generation`, the timeout, or close()."""
        with self._changed:
            self._changed.wait_for(
                lambda: self._generation > after_generation or self._closed, timeout
            )
            return self._snapshot()

    def close(self) -> None:
        """Wake every watcher so that streams can end at shutdown."""
        with self._changed:
            self._closed = True
            self._changed.notify_all()

    @property
    def closed(self) -> bool:
        return self._closed

    def _snapshot(self) -> Snapshot:
        engines = tuple(sorted(self._engines.values(), key=lambda e: (e.engine_index, e.engine_id)))
        return Snapshot(engines, self._generation)

    def _bump(self) -> None:
        self._generation += 1
        self._changed.notify_all()
