"""OutputEmitter: everything the engine tells its Sessions, through one ordered queue.

Any thread may emit (the loop its steps' outputs, callers their rejections, the
watchdog a death); the output thread drains the queue into the SessionRouter, so
nobody who emits waits on a Session. Order on the queue is the order a Session
sees: a utility call's reply follows the outputs emitted before it, and a
KvSnapshot sits exactly between the prefix-cache events it includes and those it
does not (see session_router.py).
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable, Iterable

from services.engine.observer import EngineObserver
from services.engine.request import FinishReason, Request, RequestUpdate
from services.engine.scheduler.kv_events import KvEvent, KvEventLog
from services.engine.scheduler.scheduler import Scheduler
from services.engine.session_router import (
    EngineState,
    KvSnapshot,
    SessionRouter,
    StepOutputs,
    UtilityReply,
)


class OutputEmitter:
    def __init__(self, sessions: SessionRouter, scheduler: Scheduler, kv_events: KvEventLog,
                 state: Callable[[], EngineState]) -> None:
        self.sessions = sessions
        self.observer = EngineObserver()
        self._scheduler = scheduler
        self._kv_events = kv_events
        self._state = state
        self._queue: queue.Queue[StepOutputs | UtilityReply | KvSnapshot | None] = queue.Queue()
        self._thread = threading.Thread(target=self._run, name="engine-output", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def close(self, join_timeout_s: float) -> None:
        """Deliver what is queued, then end the output thread."""
        if self._thread.is_alive():
            self._queue.put(None)
            self._thread.join(join_timeout_s)

    def is_alive(self) -> bool:
        return self._thread.is_alive()

    def emit(self, updates: list[RequestUpdate], kv_events: tuple[KvEvent, ...] = ()) -> None:
        """Queue one StepOutputs. `kv_events` only from the loop thread: the events'
        order on the output queue is their seq order (other threads emit too)."""
        if not updates and not kv_events:
            return
        if updates:
            self.observer.on_updates(updates)
        by_session: dict[str, list[RequestUpdate]] = {}
        for u in updates:
            by_session.setdefault(u.session_id, []).append(u)
        self._queue.put(StepOutputs(by_session, self._scheduler.stats(), self._state(),
                                    time.time(), kv_events=kv_events))

    def reject(self, requests: Iterable[Request], code: int, message: str) -> None:
        self.emit([
            RequestUpdate(r.request_id, r.session_id, finish_reason=FinishReason.ERROR,
                          error_code=code, error_message=message)
            for r in requests
        ])

    def reply(self, reply: UtilityReply) -> None:
        # Through the queue, so the reply follows the outputs emitted before it.
        self._queue.put(reply)

    def broadcast(self) -> None:
        """Tell every Session the engine's state (a state change)."""
        self._queue.put(StepOutputs({}, self._scheduler.stats(), self._state(), time.time(),
                                    broadcast=True))

    def flush_kv_events(self) -> None:
        if self._kv_events.has_pending:
            self.emit([], self._kv_events.drain())

    def subscribe_kv(self, session_id: str) -> None:
        """Loop thread only, the pool's owner: only there are the snapshot and the
        event stream consistent."""
        self.flush_kv_events()
        kv = self._scheduler.kv_cache
        self._queue.put(KvSnapshot(session_id, self._kv_events.epoch, self._kv_events.last_seq,
                                   kv.block_size, kv.pool.cached_hashes()))

    def _run(self) -> None:
        while (item := self._queue.get()) is not None:
            if isinstance(item, UtilityReply):
                self.sessions.reply(item)
            elif isinstance(item, KvSnapshot):
                self.sessions.subscribe_kv(item)
            else:
                self.sessions.route(item)
