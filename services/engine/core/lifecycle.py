"""Lifecycle: the engine's states, its watchdog, and how it stops or dies.

    STARTING -> RUNNING (start) -> DRAINING (shutdown) -> STOPPED
    any -> DEAD when the loop raises or the watchdog finds it stuck with work pending

DEAD is final: every request fails with UNAVAILABLE naming this engine and the
reason, pending adds are refused, and every Session hears engine_state DEAD. When
the loop is stuck it still owns the scheduler, so the watchdog path leaves the
scheduler alone and lets the Sessions end their streams instead.

The executor is closed once, at the end of either ending: on the loop thread after
the loop has exited, or on the thread that declared the engine dead. A watchdog
death closes it from the watchdog's thread, because the loop thread may be the one
stuck inside the executor, and a TP executor must then stop its workers.
"""

from __future__ import annotations

import faulthandler
import logging
import queue
import sys
import threading
import time
from collections.abc import Callable

from services.engine.core.emitter import OutputEmitter
from services.engine.core.watchdog import Watchdog
from services.engine.executor.protocol import Executor
from services.engine.messages import EngineState, InputQueue, InputType, utility_reply
from services.engine.request import UNAVAILABLE, FinishReason, RequestUpdate
from services.engine.scheduler.scheduler import Scheduler

logger = logging.getLogger(__name__)

FinishAll = Callable[[FinishReason, int, str], list[RequestUpdate]]
"""Ends every request the engine holds: (reason, error code, error message)."""


class Lifecycle:
    def __init__(self, name: str, executor: Executor, outputs: OutputEmitter,
                 input_queue: InputQueue, scheduler: Scheduler, finish_all: FinishAll,
                 watchdog_timeout_s: float) -> None:
        """`finish_all` only ever runs on the loop thread, the scheduler's owner."""
        self.name = name
        self._executor = executor
        self._outputs = outputs
        self._input_queue = input_queue
        self._scheduler = scheduler
        self._finish_all = finish_all
        self._state = EngineState.STARTING
        self._state_lock = threading.Lock()
        self._death_reason = ""
        self._listeners: list[Callable[[EngineState], None]] = []
        self._executor_closed = False
        self.drain_deadline = 0.0
        """time.monotonic() at which a drain gives up on the requests still running."""
        self._watchdog = (Watchdog(watchdog_timeout_s, self._on_watchdog_expired)
                          if watchdog_timeout_s > 0 else None)

    @property
    def state(self) -> EngineState:
        return self._state

    @property
    def death_reason(self) -> str:
        return self._death_reason

    def add_listener(self, listener: Callable[[EngineState], None]) -> None:
        self._listeners.append(listener)

    def set_state(self, state: EngineState) -> None:
        with self._state_lock:
            if self._state is EngineState.DEAD or self._state is state:
                return  # DEAD is final, whichever thread notices what next
            logger.info("%s: %s", self.name, state.name)
            self._state = state
        for listener in self._listeners:
            listener(state)

    def start(self) -> None:
        self.set_state(EngineState.RUNNING)
        if self._watchdog is not None:
            self._watchdog.start()

    def not_running_message(self) -> str:
        if self._state is EngineState.DRAINING:
            return f"{self.name} is draining and accepts no new requests"
        if self._state is EngineState.DEAD:
            return f"{self.name} is dead ({self._death_reason})"
        return f"{self.name} is {self._state.name.lower()}"

    # ---- the watchdog (fed by the loop thread) ---------------------------------

    def feed_watchdog(self) -> None:
        if self._watchdog is not None:
            self._watchdog.feed()

    def pause_watchdog(self) -> None:
        """The loop is about to block idle: idle is not stuck."""
        if self._watchdog is not None:
            self._watchdog.pause()

    def stop_watchdog(self) -> None:
        if self._watchdog is not None:
            self._watchdog.stop()

    # ---- endings ---------------------------------------------------------------

    def begin_drain(self, timeout_s: float) -> None:
        self.drain_deadline = time.monotonic() + timeout_s
        self.set_state(EngineState.DRAINING)
        self._outputs.broadcast()

    def stop(self) -> None:
        """After the drain, on the loop thread: fail what is left, then STOPPED."""
        message = (f"{self.name} is shutting down; the request did not finish within the "
                   "drain timeout")
        unfinished = self._finish_all(FinishReason.ERROR, UNAVAILABLE, message)
        if unfinished:
            logger.warning("%s: aborted %d requests left after draining", self.name,
                           len(unfinished))
        self._outputs.emit(unfinished)
        self.set_state(EngineState.STOPPED)
        self.reject_pending(f"{self.name} is shutting down")

    def die(self, reason: str, fail_requests: bool) -> None:
        """Mark the engine DEAD (once), tell everyone and close the executor;
        `fail_requests` only from the loop thread, the scheduler's owner."""
        with self._state_lock:
            if self._death_reason or self._state in (EngineState.DEAD, EngineState.STOPPED):
                return
            self._death_reason = reason
        self.set_state(EngineState.DEAD)
        self.stop_watchdog()
        message = f"{self.name} is dead ({reason}); the request did not complete"
        logger.critical("%s is dead: %s\n%s", self.name, reason, self._describe_scheduler())
        if fail_requests:
            try:
                self._outputs.emit(self._finish_all(FinishReason.ERROR, UNAVAILABLE, message))
            except Exception:
                logger.exception("could not fail the requests of a dead engine")
        self.reject_pending(message)
        self._outputs.broadcast()
        self.close_executor()

    def close_executor(self) -> None:
        """Close the executor the first time only: a stuck loop may still end, and
        die, after the watchdog has closed it."""
        with self._state_lock:
            if self._executor_closed:
                return
            self._executor_closed = True
        try:
            self._executor.close()
        except Exception:
            logger.exception("%s: closing the executor failed", self.name)

    def reject_pending(self, message: str) -> None:
        """Refuse the adds and utility calls no loop will take off the queue."""
        while True:
            try:
                kind, payload = self._input_queue.get_nowait()
            except queue.Empty:
                return
            if kind is InputType.ADD:
                self._outputs.reject([payload], UNAVAILABLE, message)
            elif kind is InputType.UTILITY:
                self._outputs.reply(utility_reply(
                    payload, failure=f"utility {payload.method!r} failed: {message}"))

    def _on_watchdog_expired(self, silent_s: float) -> None:
        assert self._watchdog is not None
        reason = (f"watchdog: the busy loop made no progress for {silent_s:.1f} s "
                  f"(limit {self._watchdog.timeout_s:g} s) with work pending")
        if stall := self._executor.describe_stall():
            reason += f"; {stall}"
        logger.critical("%s: %s; the stack of every thread follows", self.name, reason)
        faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
        # The stuck loop thread owns the scheduler: leave it alone; the Sessions end
        # the streams (see server.py).
        self.die(reason, fail_requests=False)

    def _describe_scheduler(self) -> str:
        """The scheduler's state for the fatal log record (best effort: when the
        watchdog calls this, the loop thread may still be mutating it)."""
        try:
            stats = self._scheduler.stats()
            lines = [f"scheduler: {stats}"]
            for req in list(self._scheduler.requests.values()):
                lines.append(
                    f"  {req.request_id}: {req.status.name}, prompt {len(req.prompt_token_ids)}"
                    f" tokens, {len(req.output_token_ids)} generated, {req.num_computed_tokens}"
                    f" computed, {req.num_preemptions} preemptions")
            return "\n".join(lines)
        except Exception as exc:
            return f"scheduler state unavailable: {exc!r}"
