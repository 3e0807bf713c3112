"""OutputEmitter: everything the engine tells its Sessions, in one order.

Any thread may emit (the loop its steps' outputs, callers their rejections, the
watchdog a death). Each emit is routed at once, under one lock, onto the queues of
the Sessions it concerns (SessionRouter); each Session's RPC thread writes its own
queue to the network, so nobody who emits waits on a Session. The order of emits
is the order every Session sees: a utility call's reply follows the outputs
emitted before it, and a KvSnapshot sits exactly between the prefix-cache events
it includes and those it does not (see session_router.py).

There is no output thread between the loop and the Sessions: on a machine with few
cores, every thread that wakes per token takes CPU from the model's step (a paced
model through the cluster, `benchmarks/cluster_cost.py --fixed-logits --step-ms 5`:
the hop cost 0.085 ms of CPU and 2.6 context switches per token).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable

from services.engine.core.iteration_details import IterationDetails
from services.engine.core.observer import EngineObserver
from services.engine.core.session_router import SessionRouter
from services.engine.messages import EngineState, KvSnapshot, StepOutputs, UtilityReply
from services.engine.request import FinishReason, Request, RequestUpdate
from services.engine.scheduler.kv_events import KvEvent, KvEventLog
from services.engine.scheduler.scheduler import Scheduler


class OutputEmitter:
    def __init__(self, sessions: SessionRouter, scheduler: Scheduler, kv_events: KvEventLog,
                 state: Callable[[], EngineState]) -> None:
        self.sessions = sessions
        self.observer = EngineObserver()
        self._scheduler = scheduler
        self._kv_events = kv_events
        self._state = state
        # Held while one emit is routed: emits from several threads reach every Session
        # in one order. Routing only puts on unbounded queues; it never blocks.
        self._order = threading.Lock()
        self._weight_version = ""
        self._kv_sinks: list[Callable[[tuple[KvEvent, ...]], None]] = []

    def add_kv_sink(self, sink: Callable[[tuple[KvEvent, ...]], None]) -> None:
        """Also hand every batch of prefix-cache events to `sink`, on the loop thread
        (the vLLM-format publisher): set before the loop starts."""
        self._kv_sinks.append(sink)

    def set_weight_version(self, version: str) -> None:
        """The version stamped on every output from now on (set between steps)."""
        self._weight_version = version

    def emit(self, updates: list[RequestUpdate], kv_events: tuple[KvEvent, ...] = ()) -> None:
        """Route one StepOutputs. `kv_events` only from the loop thread: so the events
        are routed in their seq order (other threads emit too)."""
        if not updates and not kv_events:
            return
        if kv_events:
            for sink in self._kv_sinks:
                sink(kv_events)
        if updates:
            self.observer.on_updates(updates)
        by_session: dict[str, list[RequestUpdate]] = {}
        for u in updates:
            by_session.setdefault(u.session_id, []).append(u)
        step = StepOutputs(by_session, self._scheduler.stats(), self._state(), time.time(),
                           kv_events=kv_events, weight_version=self._weight_version)
        with self._order:
            self.sessions.route(step)

    def reject(self, requests: Iterable[Request], code: int, message: str) -> None:
        self.emit([
            RequestUpdate(r.request_id, r.session_id, finish_reason=FinishReason.ERROR,
                          error_code=code, error_message=message)
            for r in requests
        ])

    def emit_details(self, details: IterationDetails) -> None:
        """A step's iteration details, after its outputs, to the Sessions that asked."""
        with self._order:
            self.sessions.route_details(details)

    def reply(self, reply: UtilityReply) -> None:
        with self._order:  # after the outputs emitted before it
            self.sessions.reply(reply)

    def broadcast(self) -> None:
        """Tell every Session the engine's state (a state change)."""
        step = StepOutputs({}, self._scheduler.stats(), self._state(), time.time(),
                           broadcast=True, weight_version=self._weight_version)
        with self._order:
            self.sessions.route(step)

    def flush_kv_events(self) -> None:
        if self._kv_events.has_pending:
            self.emit([], self._kv_events.drain())

    def subscribe_kv(self, session_id: str) -> None:
        """Loop thread only, the pool's owner: only there are the snapshot and the
        event stream consistent."""
        self.flush_kv_events()
        kv = self._scheduler.kv_cache
        snapshot = KvSnapshot(session_id, self._kv_events.epoch, self._kv_events.last_seq,
                              kv.block_size, kv.pool.cached_hashes())
        with self._order:
            self.sessions.subscribe_kv(snapshot)
