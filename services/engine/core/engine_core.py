"""EngineCore: the busy loop around the scheduler and the executor.

Threads: callers (the server's Session input threads) only put items on
`input_queue` (and aborts also on `aborts_queue`); the busy-loop thread owns the
scheduler and drives the executor, and routes each step's `StepOutputs` onto the
Sessions' queues (emitter.py), which the Sessions' RPC threads write to the network.
Nothing in the busy loop waits on the network.

    while state allows: process input (block only when idle); step; publish stats
    step = schedule -> execute -> update (aborts that came meanwhile go out first)

Collaborators, each in its own module:
    executor/protocol.py     Executor, the seam the loop drives (the model, at any TP size)
    core/lifecycle.py        states, watchdog, drain, stop and death
    core/sentinel.py         a failed step pauses the engine, which recovers or dies
    core/emitter.py          outputs, replies and state changes to the Sessions, in one order
    core/utilities.py        utility calls (reset_prefix_cache, get_stats, pause, ...)
    core/compiles.py         constrained requests waiting for their grammars; step masks
    core/iteration_details.py  what each step did, recorded only when somebody asked
    executor/batch_queue.py  batches in flight while the loop schedules ahead (depth > 1)
    waves/stepper.py         lockstep waves of an expert-parallel group

Prefix-cache events: the block pool records its changes in `kv_events`, on the
loop thread only; each step's StepOutputs carries the events drained at its end,
and events made outside a step's outputs (a reset, a schedule whose batch is still
executing) go out as a kv-only StepOutputs at the end of the loop iteration. A
subscription (`subscribe_kv_events`) travels on `input_queue` like a utility call:
the loop flushes the pending events, then routes the Session's KvSnapshot, so the
snapshot sits exactly between the events it includes and
those it does not (see session_router.py).
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from services.common.pooling import Pooler, TaskMismatch, resolve_params
from services.common.thread_names import name_native_thread
from services.engine.config import EngineConfig
from services.engine.core.compiles import GrammarCompiles
from services.engine.core.emitter import OutputEmitter
from services.engine.core.iteration_details import IterationRecorder, StepClock
from services.engine.core.lifecycle import Lifecycle
from services.engine.core.observer import EngineObserver
from services.engine.core.sentinel import Sentinel
from services.engine.core.session_router import SessionRouter
from services.engine.core.sleep import Sleep
from services.engine.core.utilities import PauseMode, Utilities
from services.engine.core.weight_updates import WeightUpdates
from services.engine.executor.batch_queue import BatchQueue
from services.engine.executor.protocol import Executor
from services.engine.messages import EngineState, InputQueue, InputType, UtilityCall, utility_reply
from services.engine.request import (
    FAILED_PRECONDITION,
    INTERNAL,
    INVALID_ARGUMENT,
    RESOURCE_EXHAUSTED,
    UNAVAILABLE,
    FinishReason,
    Request,
    RequestUpdate,
)
from services.engine.scheduler.kv_cache_manager import KVCacheManager
from services.engine.scheduler.kv_events import KvEventLog
from services.engine.scheduler.output import RunnerOutput, SchedulerOutput
from services.engine.scheduler.scheduler import RequestRejected, Scheduler, SchedulerStats
from services.engine.speculative.speculator import Speculator
from services.engine.waves.state import WaveState
from services.engine.waves.stepper import WaveStepper

logger = logging.getLogger(__name__)


class _UpdateFailed(Exception):
    """A step's update raised: fatal (the sentinel recovers from failed executes only)."""


@dataclass
class PendingAbort:
    """The ids of one abort call that neither of its two copies has applied yet.

    A client may reuse a request id as soon as its request ended, and the frontend
    does: it aborts what is left of a call and at once sends the next with the same id.
    Were each copy applied in full, the one that comes second (an abort_queue copy
    applied after the new ADD was taken) would abort the new request. So the early copy
    takes only the ids it found, and the copy in the input's order takes the rest,
    which can only name requests added before the abort."""

    left: list[str]

    def applied(self, request_ids: Iterable[str]) -> None:
        found = set(request_ids)
        self.left = [rid for rid in self.left if rid not in found]

    def take_all(self) -> list[str]:
        left, self.left = self.left, []
        return left


class EngineCore:
    def __init__(self, config: EngineConfig, executor: Executor) -> None:
        self.config = config
        self.executor = executor
        # Test doubles and wrappers may not say: they run generative models.
        self.pooler: Pooler | None = getattr(executor, "pooler", None)
        self.name = f"engine-core dp={config.engine_index}"
        self.kv_events = KvEventLog()
        kv_cache = KVCacheManager(executor.num_blocks, executor.block_size, self.kv_events)
        # A context longer than the whole cache could never be held: cap it.
        info = executor.model_info
        self.max_model_len = min(info.max_model_len, kv_cache.capacity_tokens)
        if self.max_model_len < info.max_model_len:
            logger.warning("max_model_len capped to the KV cache's %d tokens", self.max_model_len)
        self.scheduler = Scheduler(
            kv_cache,
            max_model_len=self.max_model_len,
            max_num_seqs=config.max_num_seqs,
            max_num_batched_tokens=config.max_num_batched_tokens,
            policy=config.scheduling_policy,
            speculator=self._speculator(config, executor),
        )
        self.input_queue: InputQueue = queue.SimpleQueue()
        self.aborts_queue: queue.SimpleQueue[PendingAbort] = queue.SimpleQueue()
        self.sessions = SessionRouter()
        self.details = IterationRecorder(config.iteration_details, self.sessions.details_asked)
        # When each batch in flight began to schedule, by its step (details only).
        self._clocks: dict[int, StepClock] = {}
        self.outputs = OutputEmitter(self.sessions, self.scheduler, self.kv_events,
                                     lambda: self.lifecycle.state)
        self.lifecycle = Lifecycle(self.name, executor, self.outputs, self.input_queue,
                                   self.scheduler, self._finish_all, config.watchdog_timeout)
        self.compiles = GrammarCompiles(
            config, info, self.scheduler, self.outputs,
            lambda rid: self.input_queue.put((InputType.GRAMMAR_READY, rid)))
        self.weights = WeightUpdates(config.weight_version, executor, self.scheduler, self.name,
                                     self.outputs.set_weight_version)
        self.outputs.set_weight_version(config.weight_version)
        self.sleep = Sleep(executor, self.scheduler, self.weights, self.lifecycle,
                           config.weight_version,
                           self._post_to_loop,
                           lambda: self.wave)
        self.sentinel = Sentinel(self.name, config.max_step_faults,
                                 config.engine_recovery_timeout_s, self.lifecycle,
                                 self.scheduler, self.outputs, executor,
                                 self._post_to_loop,
                                 lambda: self.wave)
        self.utilities = Utilities(config, self.scheduler, executor, self.lifecycle,
                                   self.outputs, self._finish_all, lambda: self.wave,
                                   self.weights, self.sleep, self.details, self.sentinel)
        self._observer = EngineObserver()
        self._stats = SchedulerStats()
        self._loop_thread = threading.Thread(target=self._run_busy_loop, name="engine-loop",
                                             daemon=True)
        self._waves: WaveStepper | None = None
        self._batch_queue = (BatchQueue(executor, config.max_concurrent_batches, self.wakeup)
                             if config.max_concurrent_batches > 1 else None)
        self._awaiting_batch = False
        # The batch being executed (not with the batch queue): what a failed step takes
        # back (see sentinel.py).
        self._executing: SchedulerOutput | None = None

    @staticmethod
    def _speculator(config: EngineConfig, executor: Executor) -> Speculator | None:
        spec = config.speculative
        if spec is None:
            return None
        if getattr(executor, "pooler", None) is not None:
            raise ValueError("speculative_config is for generation; this engine pools")
        if spec.method == "draft_model" and getattr(executor, "draft", None) is None:
            raise ValueError("speculative_config: method draft_model needs an executor "
                             "built with the draft model")
        logger.info("speculative decoding: %s", spec)
        return Speculator(spec)

    # ---- called from other threads ---------------------------------------------

    @property
    def observer(self) -> EngineObserver:
        """Metrics and tracing hooks (see main.py); set before start."""
        return self._observer

    @observer.setter
    def observer(self, observer: EngineObserver) -> None:
        self._observer = self.outputs.observer = self.compiles.observer = observer

    @property
    def state(self) -> EngineState:
        return self.lifecycle.state

    @property
    def death_reason(self) -> str:
        """Why the engine is DEAD (empty otherwise)."""
        return self.lifecycle.death_reason

    @property
    def stats(self) -> SchedulerStats:
        """The stats after the latest loop iteration (a consistent snapshot)."""
        return self._stats

    @property
    def wave(self) -> WaveState | None:
        return self._waves.state if self._waves is not None else None

    def add_state_listener(self, listener: Callable[[EngineState], None]) -> None:
        """Called (on the thread that changes it) with every new state."""
        self.lifecycle.add_listener(listener)

    def start(self) -> None:
        """Start the loop; the executor must be warm by now."""
        self.lifecycle.start()
        self._loop_thread.start()

    def join_waves(self, check_interval: int,
                   announce: Callable[[int], None] | None = None,
                   prefill_interval: int = 1) -> None:
        """Step in lockstep waves with the other ranks of an expert-parallel group (call
        before start). `announce(wave)` asks the coordinator to start `wave` on the
        other ranks; their starts come back through `start_wave`. New requests start
        only every `prefill_interval` steps of a wave (on every rank alike)."""
        if self.config.max_concurrent_batches > 1:
            raise ValueError("an expert-parallel engine runs one batch at a time "
                             "(max_concurrent_batches must be 1)")
        self._waves = WaveStepper(check_interval, announce, self.executor, self.name,
                                  prefill_interval)

    def start_wave(self, wave: int) -> None:
        """Another rank started `wave` (relayed by the coordinator); stale ones are ignored."""
        self.input_queue.put((InputType.START_WAVE, wave))

    def add_request(self, request: Request) -> None:
        if self.state is not EngineState.RUNNING:
            self.outputs.reject([request], UNAVAILABLE, self.lifecycle.not_running_message())
            return
        self.input_queue.put((InputType.ADD, request))

    def abort_requests(self, request_ids: list[str]) -> None:
        # Both queues: aborts_queue applies right after the running step's execute,
        # input_queue keeps the order with an ADD that has not been processed yet. One
        # PendingAbort on both, so that no id is aborted twice (see there).
        abort = PendingAbort(list(request_ids))
        self.aborts_queue.put(abort)
        self.input_queue.put((InputType.ABORT, abort))

    def call_utility(self, call: UtilityCall) -> None:
        """Run a utility on the loop thread; the reply reaches call.session_id."""
        if self.state not in (EngineState.RUNNING, EngineState.DRAINING,
                              EngineState.PAUSED_FAULT):
            # No loop will take it off the queue: answer now.
            message = self.lifecycle.not_running_message()
            self.outputs.reply(utility_reply(
                call, failure=f"utility {call.method!r} failed: {message}"))
            return
        self.input_queue.put((InputType.UTILITY, call))

    def subscribe_kv_events(self, session_id: str) -> None:
        """Send the Session a snapshot of the prefix cache, then its every change."""
        self.input_queue.put((InputType.KV_SUBSCRIBE, session_id))

    def _post_to_loop(self, fn: Callable[[], None]) -> None:
        """Run `fn` on the loop thread (for collaborators that work on threads of their own)."""
        self.input_queue.put((InputType.CALL, fn))

    def wakeup(self) -> None:
        self.input_queue.put((InputType.WAKEUP, None))

    def fail(self, reason: str) -> None:
        """Declare the engine DEAD from outside the loop (a tensor-parallel worker died):
        the Sessions end every stream, and the executor is closed, which makes a step
        waiting on the lost worker fail."""
        self.lifecycle.die(reason, fail_requests=False)

    def shutdown(self, drain_timeout_s: float = 0.0, join_timeout_s: float = 10.0) -> None:
        """Stop accepting, finish in-flight requests for up to drain_timeout_s, abort the
        rest with UNAVAILABLE, tell every Session STOPPED and join the threads."""
        if self._loop_thread.is_alive():
            self.input_queue.put((InputType.SHUTDOWN, drain_timeout_s))
            deadline = time.monotonic() + join_timeout_s
            # A loop the watchdog declared DEAD may never return: stop waiting then.
            while (self._loop_thread.is_alive() and self.state is not EngineState.DEAD
                   and time.monotonic() < deadline):
                self._loop_thread.join(0.1)
        elif self.state is EngineState.STARTING:
            self.lifecycle.set_state(EngineState.STOPPED)
            self.lifecycle.close_executor()
        self.sessions.wake_all()

    # ---- the busy loop ---------------------------------------------------------

    def _run_busy_loop(self) -> None:
        name_native_thread()
        try:
            while self.state in (EngineState.RUNNING, EngineState.DRAINING,
                                 EngineState.PAUSED_FAULT):
                self.lifecycle.feed_watchdog()
                self._process_input_queue()
                if self.weights.commit_pending and not self._batch_queue:
                    self.weights.run_commit()  # between steps, no batch in flight
                if self._can_step():
                    self._guarded_step()
                if self.utilities.awaits_drain:
                    self.utilities.settle(batches_in_flight=bool(self._batch_queue))
                self.outputs.flush_kv_events()
                self._publish_stats()
                if self.state is EngineState.DRAINING and self._drain_over():
                    break
        except Exception as exc:
            logger.exception("%s: the busy loop failed; the engine is dead", self.name)
            self.lifecycle.die(f"{type(exc).__name__}: {exc}", fail_requests=True)
            return
        if self.state is not EngineState.DEAD:  # the watchdog may have given up on us
            self._stop()

    def _process_input_queue(self) -> None:
        # Waiting for grammars to compile is idle too, also while draining; so is a
        # pause for a fault (recovery posts its outcome on the queue).
        idle = ((self.state in (EngineState.RUNNING, EngineState.PAUSED_FAULT)
                 or bool(self.compiles)) and not self._can_step())
        if idle:
            self.lifecycle.pause_watchdog()
        # Waiting on an executing batch is not idle: the watchdog keeps watching.
        block = idle or self._awaiting_batch
        self._awaiting_batch = False
        # A compile's deadline must end the wait even when no input comes.
        draining = self.state is EngineState.DRAINING
        timeout = (self.compiles.wait_s(self.lifecycle.drain_deadline if draining else None)
                   if block else None)
        # empty() first: a step's iteration usually finds nothing, and a raised Empty
        # costs more than the check.
        while block or not self.input_queue.empty():
            try:
                kind, payload = self.input_queue.get(block=block, timeout=timeout)
            except queue.Empty:
                break
            if block:
                self.lifecycle.feed_watchdog()
            block = False
            self._handle_input(kind, payload)
        if self.compiles:
            self.compiles.expire()

    def _can_step(self) -> bool:
        if self.sentinel.halted:
            return False  # (a batch queue is never paused: its faults are fatal)
        if self._waves is not None and self._waves.running:
            return True  # every rank steps while the wave runs, with or without work
        if self._batch_queue:
            return True  # its outputs must be collected, even if nobody waits for them
        return self._may_schedule()

    def _may_schedule(self) -> bool:
        """Whether a new batch may start: there is work, and neither a pause, sleep nor a
        weight update (held, or committing) stops it."""
        if self.weights.blocks_scheduling or self.sleep.asleep:
            return False
        paused = self.utilities.pause_mode
        if paused is None:
            return self.scheduler.has_work()
        # Paused "wait" still runs what is running (admission is off meanwhile).
        return paused is PauseMode.WAIT and bool(self.scheduler.running)

    def _handle_input(self, kind: InputType, payload: Any) -> None:
        if kind is InputType.ADD:
            self._add(payload)
        elif kind is InputType.GRAMMAR_READY:
            if (request := self.compiles.ready(payload)) is not None:
                # Added even while draining: it was accepted before the drain began.
                self._enqueue(request)
        elif kind is InputType.ABORT:
            # In the input's order: whatever the ids name now was added before the abort.
            self.outputs.emit(self._abort(payload.take_all()))
        elif kind is InputType.UTILITY:
            self.utilities.run(payload)
        elif kind is InputType.KV_SUBSCRIBE:
            self.outputs.subscribe_kv(payload)
        elif kind is InputType.CALL:
            payload()
        elif kind is InputType.START_WAVE and self._waves is not None:
            if self.sleep.asleep:
                # Its weights or cache are gone: it cannot run the wave's batches. A group
                # sleeps as a whole (the frontend's sleep reaches every engine).
                logger.error("%s: asleep; not joining DP wave %s that another rank started",
                             self.name, payload)
                return
            self._waves.join(payload)
        elif kind is InputType.SHUTDOWN and self.state is EngineState.RUNNING:
            # A drain lets in-flight requests finish; a pause must not hold them back.
            self.utilities.resume()
            self.lifecycle.begin_drain(payload)
        elif kind is InputType.SHUTDOWN and self.state is EngineState.PAUSED_FAULT:
            # Nothing can finish before the group re-forms: stop now.
            self.lifecycle.begin_drain(0.0)

    def _add(self, request: Request) -> None:
        if self.state is not EngineState.RUNNING:
            self.outputs.reject([request], UNAVAILABLE, self.lifecycle.not_running_message())
            return
        num_waiting = len(self.scheduler.waiting) + len(self.compiles)
        if num_waiting >= self.config.max_waiting_requests:
            self.outputs.reject([request], RESOURCE_EXHAUSTED, (
                f"{self.name} is overloaded: {num_waiting} requests are "
                f"waiting (max_waiting_requests {self.config.max_waiting_requests}); "
                "retry later"))
            return
        if not self._takes_task(request):
            return
        if request.sampling.constraint is not None and request.grammar is None:
            self.compiles.start(request)
            return
        self._enqueue(request)

    def _takes_task(self, request: Request) -> bool:
        """Whether this engine runs the request's kind (pooling or generation), its
        pooling settings completed with the model's defaults; else it is rejected."""
        if (request.pooling is None) != (self.pooler is None):
            served = ("generation" if self.pooler is None
                      else " and ".join(self.pooler.tasks))
            asked = "generation" if request.pooling is None else request.pooling.task.value
            self.outputs.reject([request], FAILED_PRECONDITION,
                                f"{self.name} serves {served}, not {asked}")
            return False
        if request.pooling is not None and self.pooler is not None:
            try:
                request.pooling = resolve_params(request.pooling, self.pooler)
            except TaskMismatch as exc:
                self.outputs.reject([request], FAILED_PRECONDITION, str(exc))
                return False
            except ValueError as exc:
                self.outputs.reject([request], INVALID_ARGUMENT, str(exc))
                return False
        return True

    def _enqueue(self, request: Request) -> None:
        try:
            self.scheduler.add_request(request)
            self._observer.on_added(request)
        except RequestRejected as exc:
            self.outputs.reject([request], INVALID_ARGUMENT, str(exc))
        except Exception as exc:
            # A bad request must not take the engine (and everyone else's requests) down.
            logger.exception("%s: could not add request %s", self.name, request.request_id)
            self.outputs.reject([request], INTERNAL,
                                f"{self.name} could not add the request: {exc}")

    # ---- the step: schedule, execute, update -------------------------------------

    def _guarded_step(self) -> None:
        """A step whose failure goes to the sentinel (it pauses, takes the step back and
        recovers) rather than killing the engine; with a batch queue, or when the
        sentinel gives up, the failure is fatal as before."""
        try:
            self.step()
        except _UpdateFailed as exc:
            raise exc.__cause__ or exc from None  # a bug in the update, not a fault
        except Exception as exc:
            failed, self._executing = self._executing, None
            self._clocks.clear()
            if self._batch_queue is not None or not self.sentinel.on_step_fault(exc, failed):
                raise
            return
        self.sentinel.stepped()

    def step(self) -> None:
        """Schedule, execute, update. The batch queue executes on its own thread while
        the loop schedules ahead; in a wave, a rank with nothing scheduled still
        executes a dummy batch."""
        if self._waves is not None:
            self._waves.step(self._schedule_in_wave, self._update, self.scheduler.has_work)
            return
        if self._batch_queue is not None:
            self._awaiting_batch = self._batch_queue.step(self._schedule, self._update)
            return
        out = self._schedule()
        if out is None:
            time.sleep(0.001)  # work exists but none fits yet; do not spin hot
            return
        self._update(out, self.executor.execute(out))

    def _schedule(self, admit: bool = True) -> SchedulerOutput | None:
        """The next batch, its grammar mask building; None when nothing fits, or nothing
        may start (batches in flight are still collected). `admit` False: no waiting
        request starts."""
        if not self._may_schedule():
            return None
        timed = self.details.wanted
        if timed:
            started_at, start = time.time(), self.details.clock()
        out = self.scheduler.schedule(admit)
        if out.is_empty:
            return None
        out = self.compiles.with_grammar_mask(out)
        if timed:
            self._clocks[out.step] = StepClock(started_at, self.details.clock() - start)
        if self._batch_queue is None:
            self._executing = out
        self._observer.on_scheduled(out)
        return out

    def _schedule_in_wave(self, admit: bool) -> SchedulerOutput | None:
        # Paused "keep" freezes every request, but the rank still meets the wave.
        return None if self.utilities.pause_mode is PauseMode.KEEP else self._schedule(admit)

    def _update(self, out: SchedulerOutput, result: RunnerOutput) -> None:
        self._executing = None
        try:
            self._update_from(out, result)
        except Exception as exc:
            # The scheduler may be half updated: no retry can be trusted.
            raise _UpdateFailed() from exc

    def _update_from(self, out: SchedulerOutput, result: RunnerOutput) -> None:
        clock = self._clocks.pop(out.step, None) if self._clocks else None
        start = self.details.clock() if clock is not None else 0.0
        # Aborts that arrived while the batch executed go out before its outputs.
        aborted = self._apply_aborts()
        updates = aborted + self.scheduler.update_from_output(out, result)
        self.outputs.emit(updates, self.kv_events.drain())
        if clock is not None:
            wave = self.wave
            details = self.details.build(
                out, result, clock, self.details.clock() - start,
                (wave.wave, wave.steps) if wave is not None and wave.running else None)
            self._observer.on_iteration(details)
            self.outputs.emit_details(details)

    # ---- requests (on the loop thread) --------------------------------------------

    def _apply_aborts(self) -> list[RequestUpdate]:
        updates: list[RequestUpdate] = []
        while not self.aborts_queue.empty():  # the loop is its only reader
            abort = self.aborts_queue.get_nowait()
            done = self._abort(abort.left)
            abort.applied(update.request_id for update in done)
            updates += done
        return updates

    def _abort(self, request_ids: list[str]) -> list[RequestUpdate]:
        """Abort requests wherever they wait: compiling or in the scheduler."""
        return self.compiles.abort(request_ids) + self.scheduler.abort_requests(request_ids)

    def _finish_all(self, reason: FinishReason, error_code: int = 0,
                    error_message: str = "") -> list[RequestUpdate]:
        """End every request, compiling or in the scheduler."""
        return (self.compiles.finish_all(reason, error_code, error_message)
                + self.scheduler.finish_all(reason, error_code, error_message))

    def _publish_stats(self) -> None:
        self._stats = self.scheduler.stats()

    def _drain_over(self) -> bool:
        # A rank must not leave a running wave: the others' collectives need it.
        in_wave = self._waves is not None and self._waves.running
        return ((not self.scheduler.has_work() and not in_wave and not self.compiles)
                or time.monotonic() >= self.lifecycle.drain_deadline)

    def _stop(self) -> None:
        """After the loop has exited (on its thread)."""
        self.lifecycle.stop_watchdog()
        if self._batch_queue is not None:
            self._batch_queue.close(self.name)
        self.compiles.close()
        self.lifecycle.stop()
        self._publish_stats()
        self.outputs.broadcast()
        self.lifecycle.close_executor()
