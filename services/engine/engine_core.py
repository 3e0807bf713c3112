"""EngineCore: the busy loop around the scheduler and the model runner.

Threads: callers (the server's Session input threads) only put items on
`input_queue` (and aborts also on `aborts_queue`); the busy-loop thread owns the
scheduler and the runner; the output thread moves each step's `StepOutputs` from
`output_queue` to the Sessions. Nothing in the busy loop waits on the network.

    while state allows: process input (block only when idle); step; publish stats
    step = schedule -> execute -> apply aborts -> update

With a batch queue (`max_concurrent_batches` > 1) execute runs on an executor
thread: the loop schedules the next batch while the previous one executes (a
request whose tokens are in flight is not scheduled again until they come back),
and collects the oldest batch when the queue is full or nothing else can start.

Utility calls (reset_prefix_cache, get_stats, pause, resume, profile) travel on
`input_queue` like adds, so they run on the loop thread between steps, in order
with the requests around them; each reply goes back to the calling Session. A
failing or unknown call is answered with its error and changes nothing else.
Pausing stops scheduling, not the engine: it stays RUNNING and healthy, and new
requests queue up until `resume` (modes: abort = abort everything first; wait =
admit nothing new but let running requests finish; keep = freeze all requests).

Prefix-cache events: the block pool records its changes in `kv_events`, on the
loop thread only; each step's StepOutputs carries the events drained at its end,
and events made outside a step's outputs (a reset, a schedule whose batch is still
executing) go out as a kv-only StepOutputs at the end of the loop iteration. A
subscription (`subscribe_kv_events`) travels on `input_queue` like a utility call:
the loop flushes the pending events, then puts the Session's KvSnapshot on the
output queue, so the snapshot sits exactly between the events it includes and
those it does not (see session_router.py).

Structured output: a request with an output constraint first waits outside the
scheduler while its grammar compiles on the compiler's pool (structured/), so it
holds back nobody; the result comes back as a GRAMMAR_READY input item, and a
compile past grammar_compile_timeout_s fails only that request. After each
schedule() the token bitmask of the step's constrained rows starts building on the
mask thread; the runner waits for it after the forward pass, before sampling.

Lifecycle: STARTING -> RUNNING (start) -> DRAINING (shutdown) -> STOPPED, or DEAD
when the loop raises or the watchdog finds it stuck with work pending. DEAD is
final: every request fails with UNAVAILABLE naming this engine and the reason,
pending adds are refused, and every Session hears engine_state DEAD. When the
loop is stuck it still owns the scheduler, so the watchdog path leaves the
scheduler alone and lets the Sessions end their streams instead.
"""

from __future__ import annotations

import dataclasses
import enum
import faulthandler
import json
import logging
import queue
import sys
import tempfile
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from services.common.model_info import ModelInfo
from services.engine.config import EngineConfig
from services.engine.observer import EngineObserver
from services.engine.request import (
    INTERNAL,
    INVALID_ARGUMENT,
    RESOURCE_EXHAUSTED,
    UNAVAILABLE,
    FinishReason,
    Request,
    RequestUpdate,
)
from services.engine.scheduler.kv_cache_manager import KVCacheManager
from services.engine.scheduler.kv_events import KvEvent, KvEventLog
from services.engine.scheduler.output import RunnerOutput, SchedulerOutput
from services.engine.scheduler.scheduler import RequestRejected, Scheduler, SchedulerStats
from services.engine.session_router import (
    EngineState,
    KvSnapshot,
    SessionRouter,
    StepOutputs,
    UtilityReply,
)
from services.engine.structured.compiler import Compiled, GrammarCompiler
from services.engine.structured.step_mask import StepMasks
from services.engine.watchdog import Watchdog
from services.engine.wave import WaveState

logger = logging.getLogger(__name__)



class InputType(enum.Enum):
    ADD = enum.auto()
    ABORT = enum.auto()
    WAKEUP = enum.auto()
    SHUTDOWN = enum.auto()
    UTILITY = enum.auto()
    START_WAVE = enum.auto()
    GRAMMAR_READY = enum.auto()
    KV_SUBSCRIBE = enum.auto()


class PauseMode(enum.Enum):
    ABORT = "abort"
    WAIT = "wait"
    KEEP = "keep"


@dataclass(slots=True)
class _Compiling:
    """A constrained request whose grammar is compiling: it waits here, outside the
    scheduler, so it holds back nobody."""

    request: Request
    future: Future[Compiled]
    deadline: float
    """time.monotonic() past which the compile has failed."""
    started: float
    """time.time() when it started, for the trace."""


@dataclass(frozen=True, slots=True)
class UtilityCall:
    session_id: str
    call_id: int
    method: str
    args: dict[str, Any]


class ModelRunner(Protocol):
    """What the core needs of services.engine.worker.model_runner.ModelRunner."""

    @property
    def num_blocks(self) -> int: ...

    @property
    def block_size(self) -> int: ...

    @property
    def model_info(self) -> ModelInfo: ...

    def execute(self, out: SchedulerOutput) -> RunnerOutput: ...

    # Only for expert-parallel groups (see join_waves):
    def execute_dummy(self) -> None: ...

    def any_rank_has_work(self, has_work: bool) -> bool: ...


class EngineCore:
    def __init__(self, config: EngineConfig, runner: ModelRunner) -> None:
        self.config = config
        self.runner = runner
        self.kv_events = KvEventLog()
        kv_cache = KVCacheManager(runner.num_blocks, runner.block_size, self.kv_events)
        # A context longer than the whole cache could never be held: cap it.
        self.max_model_len = min(runner.model_info.max_model_len, kv_cache.capacity_tokens)
        if self.max_model_len < runner.model_info.max_model_len:
            logger.warning("max_model_len capped to the KV cache's %d tokens", self.max_model_len)
        self.scheduler = Scheduler(
            kv_cache,
            max_model_len=self.max_model_len,
            max_num_seqs=config.max_num_seqs,
            max_num_batched_tokens=config.max_num_batched_tokens,
            policy=config.scheduling_policy,
        )
        self.input_queue: queue.Queue[tuple[InputType, Any]] = queue.Queue()
        self.aborts_queue: queue.Queue[list[str]] = queue.Queue()
        self.output_queue: queue.Queue[StepOutputs | UtilityReply | KvSnapshot | None] = (
            queue.Queue())
        self.sessions = SessionRouter()
        self.observer = EngineObserver()  # metrics and tracing hooks (see main.py)
        self.name = f"engine-core dp={config.engine_index}"
        self._state = EngineState.STARTING
        self._state_lock = threading.Lock()
        self._death_reason = ""
        self._state_listeners: list[Callable[[EngineState], None]] = []
        self._stats = SchedulerStats()
        self._drain_deadline = 0.0
        self._pause_mode: PauseMode | None = None
        self._utilities: dict[str, Callable[[dict[str, Any]], dict[str, Any]]] = {
            "reset_prefix_cache": self._reset_prefix_cache,
            "get_stats": self._get_stats,
            "pause": self._pause,
            "resume": self._resume,
            "profile": self._profile,
        }
        self._loop_thread = threading.Thread(target=self._run_busy_loop, name="engine-loop",
                                             daemon=True)
        self._output_thread = threading.Thread(target=self._run_output_loop,
                                               name="engine-output", daemon=True)
        self._watchdog = (Watchdog(config.watchdog_timeout, self._on_watchdog_expired)
                          if config.watchdog_timeout > 0 else None)
        # Depth > 1: the runner executes on its own thread while the loop schedules ahead.
        self._batch_queue: deque[tuple[Future[RunnerOutput], SchedulerOutput]] | None = None
        self._wave: WaveState | None = None
        self._announce_wave: Callable[[int], None] | None = None
        self._awaiting_batch = False
        if config.max_concurrent_batches > 1:
            self._batch_queue = deque()
            self._executor = ThreadPoolExecutor(1, thread_name_prefix="engine-execute")
        # Structured output: started on the first constrained request.
        self._grammars: GrammarCompiler | None = None
        self._masks: StepMasks | None = None
        self._compiling: dict[str, _Compiling] = {}

    # ---- called from other threads ---------------------------------------------

    @property
    def state(self) -> EngineState:
        return self._state

    @property
    def death_reason(self) -> str:
        """Why the engine is DEAD (empty otherwise)."""
        return self._death_reason

    @property
    def stats(self) -> SchedulerStats:
        """The stats after the latest loop iteration (a consistent snapshot)."""
        return self._stats

    def add_state_listener(self, listener: Callable[[EngineState], None]) -> None:
        """Called (on the thread that changes it) with every new state."""
        self._state_listeners.append(listener)

    def start(self) -> None:
        """Start the loop; the runner must be warm by now."""
        self._output_thread.start()
        self._set_state(EngineState.RUNNING)
        if self._watchdog is not None:
            self._watchdog.start()
        self._loop_thread.start()

    def join_waves(self, check_interval: int,
                   announce: Callable[[int], None] | None = None) -> None:
        """Step in lockstep waves with the other ranks of an expert-parallel group (call
        before start). `announce(wave)` asks the coordinator to start `wave` on the
        other ranks; their starts come back through `start_wave`."""
        if self.config.max_concurrent_batches > 1:
            raise ValueError("an expert-parallel engine runs one batch at a time "
                             "(max_concurrent_batches must be 1)")
        self._wave = WaveState(check_interval)
        self._announce_wave = announce

    def start_wave(self, wave: int) -> None:
        """Another rank started `wave` (relayed by the coordinator); stale ones are ignored."""
        self.input_queue.put((InputType.START_WAVE, wave))

    @property
    def wave(self) -> WaveState | None:
        return self._wave

    def add_request(self, request: Request) -> None:
        if self._state is not EngineState.RUNNING:
            self._reject([request], UNAVAILABLE, self._not_running_message())
            return
        self.input_queue.put((InputType.ADD, request))

    def abort_requests(self, request_ids: list[str]) -> None:
        # Both queues: aborts_queue applies right after the running step's execute,
        # input_queue keeps the order with an ADD that has not been processed yet.
        self.aborts_queue.put(request_ids)
        self.input_queue.put((InputType.ABORT, request_ids))

    def call_utility(self, call: UtilityCall) -> None:
        """Run a utility on the loop thread; the reply reaches call.session_id."""
        if self._state not in (EngineState.RUNNING, EngineState.DRAINING):
            # No loop will take it off the queue: answer now.
            self.sessions.reply(self._utility_reply(
                call, failure=f"utility {call.method!r} failed: {self._not_running_message()}"))
            return
        self.input_queue.put((InputType.UTILITY, call))

    def subscribe_kv_events(self, session_id: str) -> None:
        """Send the Session a snapshot of the prefix cache, then its every change."""
        # Through the loop thread, the pool's owner: only there are the snapshot and
        # the event stream consistent.
        self.input_queue.put((InputType.KV_SUBSCRIBE, session_id))

    def wakeup(self) -> None:
        self.input_queue.put((InputType.WAKEUP, None))

    def shutdown(self, drain_timeout_s: float = 0.0, join_timeout_s: float = 10.0) -> None:
        """Stop accepting, finish in-flight requests for up to drain_timeout_s, abort the
        rest with UNAVAILABLE, tell every Session STOPPED and join the threads."""
        if self._loop_thread.is_alive():
            self.input_queue.put((InputType.SHUTDOWN, drain_timeout_s))
            deadline = time.monotonic() + join_timeout_s
            # A loop the watchdog declared DEAD may never return: stop waiting then.
            while (self._loop_thread.is_alive() and self._state is not EngineState.DEAD
                   and time.monotonic() < deadline):
                self._loop_thread.join(0.1)
        elif self._state is EngineState.STARTING:
            self._set_state(EngineState.STOPPED)
        if self._output_thread.is_alive():
            self.output_queue.put(None)
            self._output_thread.join(join_timeout_s)
        self.sessions.wake_all()

    # ---- the busy loop ---------------------------------------------------------

    def _run_busy_loop(self) -> None:
        try:
            while self._state in (EngineState.RUNNING, EngineState.DRAINING):
                self._feed_watchdog()
                self._process_input_queue()
                if self._can_step():
                    self.step()
                self._flush_kv_events()
                self._publish_stats()
                if self._state is EngineState.DRAINING and self._drain_over():
                    break
        except Exception as exc:
            logger.exception("%s: the busy loop failed; the engine is dead", self.name)
            self._die(f"{type(exc).__name__}: {exc}", fail_requests=True)
            return
        if self._state is not EngineState.DEAD:  # the watchdog may have given up on us
            self._stop()

    def _process_input_queue(self) -> None:
        # Waiting for grammars to compile is idle too, also while draining.
        idle = ((self._state is EngineState.RUNNING or bool(self._compiling))
                and not self._can_step())
        if idle and self._watchdog is not None:
            self._watchdog.pause()  # idle is not stuck
        # Waiting on an executing batch is not idle: the watchdog keeps watching.
        block = idle or self._awaiting_batch
        self._awaiting_batch = False
        # A compile's deadline must end the wait even when no input comes.
        timeout = self._compile_wait() if block else None
        while True:
            try:
                kind, payload = self.input_queue.get(block=block, timeout=timeout)
            except queue.Empty:
                break
            if block:
                self._feed_watchdog()
            block = False
            self._handle_input(kind, payload)
        if self._compiling:
            self._expire_compiles()

    def _can_step(self) -> bool:
        if self._wave is not None and self._wave.running:
            return True  # every rank steps while the wave runs, with or without work
        if self._batch_queue:
            return True  # its outputs must be collected, even if nobody waits for them
        if self._pause_mode is None:
            return self.scheduler.has_work()
        # Paused "wait" still runs what is running (admission is off meanwhile).
        return self._pause_mode is PauseMode.WAIT and bool(self.scheduler.running)

    def _feed_watchdog(self) -> None:
        if self._watchdog is not None:
            self._watchdog.feed()

    def _handle_input(self, kind: InputType, payload: Any) -> None:
        if kind is InputType.ADD:
            self._add(payload)
        elif kind is InputType.GRAMMAR_READY:
            self._grammar_ready(payload)
        elif kind is InputType.ABORT:
            self._emit(self._abort(payload))
        elif kind is InputType.UTILITY:
            self._run_utility(payload)
        elif kind is InputType.KV_SUBSCRIBE:
            self._subscribe_kv(payload)
        elif kind is InputType.START_WAVE and self._wave is not None:
            if self._wave.start(payload):
                logger.debug("%s: joined wave %d", self.name, payload)
        elif kind is InputType.SHUTDOWN and self._state is EngineState.RUNNING:
            # A drain lets in-flight requests finish; a pause must not hold them back.
            self._resume({})
            self._drain_deadline = time.monotonic() + payload
            self._set_state(EngineState.DRAINING)
            self._broadcast()

    def _add(self, request: Request) -> None:
        if self._state is not EngineState.RUNNING:
            self._reject([request], UNAVAILABLE, self._not_running_message())
            return
        num_waiting = len(self.scheduler.waiting) + len(self._compiling)
        if num_waiting >= self.config.max_waiting_requests:
            self._reject([request], RESOURCE_EXHAUSTED, (
                f"{self.name} is overloaded: {num_waiting} requests are "
                f"waiting (max_waiting_requests {self.config.max_waiting_requests}); "
                "retry later"))
            return
        if request.sampling.constraint is not None and request.grammar is None:
            self._start_compile(request)
            return
        self._enqueue(request)

    def _enqueue(self, request: Request) -> None:
        try:
            self.scheduler.add_request(request)
            self.observer.on_added(request)
        except RequestRejected as exc:
            self._reject([request], INVALID_ARGUMENT, str(exc))
        except Exception as exc:
            # A bad request must not take the engine (and everyone else's requests) down.
            logger.exception("%s: could not add request %s", self.name, request.request_id)
            self._reject([request], INTERNAL, f"{self.name} could not add the request: {exc}")

    def step(self) -> None:
        if self._wave is not None:
            self._step_in_wave(self._wave)
            return
        if self._batch_queue is not None:
            self._step_with_batch_queue(self._batch_queue)
            return
        out = self.scheduler.schedule()
        if out.is_empty:
            time.sleep(0.001)  # work exists but none fits yet; do not spin hot
            return
        out = self._with_grammar_mask(out)
        self.observer.on_scheduled(out)
        self._update(out, self.runner.execute(out))

    def _step_with_batch_queue(self, batches: deque[tuple[Future[RunnerOutput],
                                                         SchedulerOutput]]) -> None:
        """Schedule the next batch while earlier ones execute on the executor thread.
        The oldest is collected when the queue is full or once it is done; until then
        the loop waits for input (a new request may make another batch) or for the
        done batch's wakeup."""
        if len(batches) < self.config.max_concurrent_batches:
            out = self.scheduler.schedule()
            if not out.is_empty:
                out = self._with_grammar_mask(out)
                self.observer.on_scheduled(out)
                future = self._executor.submit(self.runner.execute, out)
                future.add_done_callback(lambda _: self.wakeup())
                batches.append((future, out))
                if len(batches) < self.config.max_concurrent_batches:
                    return  # back to the loop: take input, then try to start another
            elif not batches:
                time.sleep(0.001)  # work exists but none fits yet; do not spin hot
                return
            elif not batches[0][0].done():
                self._awaiting_batch = True
                return
        future, out = batches.popleft()
        self._update(out, future.result())

    def _step_in_wave(self, wave: WaveState) -> None:
        """One lockstep step of an expert-parallel group: a real batch, or a dummy one
        when this rank has nothing to run, so that the MoE collectives line up; every
        check interval the ranks agree whether the wave goes on."""
        if not wave.running and wave.start_local() and self._announce_wave is not None:
            self._announce_wave(wave.wave)
        out = self.scheduler.schedule() if self._pause_mode is not PauseMode.KEEP else None
        dummy = out is None or out.is_empty
        if dummy:
            self.runner.execute_dummy()
        else:
            assert out is not None
            out = self._with_grammar_mask(out)
            self.observer.on_scheduled(out)
            self._update(out, self.runner.execute(out))
        if wave.stepped(dummy) and wave.agreed(
                self.runner.any_rank_has_work(self.scheduler.has_work())):
            logger.info("%s: wave %d ended; idle until new work", self.name, wave.wave - 1)

    # ---- structured output (on the loop thread) ---------------------------------

    def _start_compile(self, request: Request) -> None:
        constraint = request.sampling.constraint
        assert constraint is not None
        rid = request.request_id
        if rid in self._compiling:
            self._reject([request], INVALID_ARGUMENT, f"request id {rid!r} is already in use")
            return
        try:
            # Fail what can never run now (a duplicate id too), not after its compile.
            self.scheduler.check_admissible(request)
        except RequestRejected as exc:
            self._reject([request], INVALID_ARGUMENT, str(exc))
            return
        if self._grammars is None:
            self._grammars = GrammarCompiler(self.runner.model_info,
                                             self.config.grammar_compile_workers,
                                             self.config.grammar_cache_size)
        future = self._grammars.compile(constraint)
        self._compiling[rid] = _Compiling(
            request, future, time.monotonic() + self.config.grammar_compile_timeout_s,
            time.time())
        # The loop may be blocked on input: the result comes to it as an input item.
        future.add_done_callback(
            lambda _: self.input_queue.put((InputType.GRAMMAR_READY, rid)))

    def _grammar_ready(self, request_id: str) -> None:
        pending = self._compiling.pop(request_id, None)
        if pending is None:
            return  # aborted or timed out meanwhile
        request = pending.request
        try:
            compiled = pending.future.result()
        except Exception as exc:
            self._reject([request], INVALID_ARGUMENT, str(exc))
            return
        request.grammar = compiled.grammar
        request.grammar_compile = (pending.started, time.time())
        self.observer.on_grammar_compiled(compiled.seconds, compiled.cached)
        # Added even while draining: it was accepted before the drain began.
        self._enqueue(request)

    def _compile_wait(self) -> float | None:
        if not self._compiling:
            return None
        first = min(p.deadline for p in self._compiling.values())
        if self._state is EngineState.DRAINING:
            first = min(first, self._drain_deadline)
        return max(first - time.monotonic(), 0.0)

    def _expire_compiles(self) -> None:
        now = time.monotonic()
        expired = [p for p in self._compiling.values() if p.deadline <= now]
        for pending in expired:
            del self._compiling[pending.request.request_id]
            pending.future.cancel()
            constraint = pending.request.sampling.constraint
            assert constraint is not None
            self._reject([pending.request], INVALID_ARGUMENT, (
                f"{constraint.field}: compiling it took longer than this engine's "
                f"grammar_compile_timeout_s ({self.config.grammar_compile_timeout_s:g} s); "
                "simplify the constraint"))

    def _abort(self, request_ids: list[str]) -> list[RequestUpdate]:
        """Abort requests wherever they wait: compiling or in the scheduler."""
        return self._abort_compiles(request_ids) + self.scheduler.abort_requests(request_ids)

    def _finish_all(self, reason: FinishReason, error_code: int = 0,
                    error_message: str = "") -> list[RequestUpdate]:
        """End every request, compiling or in the scheduler."""
        return (self._finish_compiles(reason, error_code, error_message)
                + self.scheduler.finish_all(reason, error_code, error_message))

    def _abort_compiles(self, request_ids: Iterable[str]) -> list[RequestUpdate]:
        updates = []
        for rid in request_ids:
            pending = self._compiling.pop(rid, None)
            if pending is not None:
                pending.future.cancel()
                updates.append(RequestUpdate(rid, pending.request.session_id,
                                             finish_reason=FinishReason.ABORT))
        return updates

    def _finish_compiles(self, reason: FinishReason, error_code: int = 0,
                         error_message: str = "") -> list[RequestUpdate]:
        pending, self._compiling = list(self._compiling.values()), {}
        for p in pending:
            p.future.cancel()
        return [RequestUpdate(p.request.request_id, p.request.session_id,
                              finish_reason=reason, error_code=error_code,
                              error_message=error_message) for p in pending]

    def _with_grammar_mask(self, out: SchedulerOutput) -> SchedulerOutput:
        """Start building the token mask of `out`'s constrained rows (it is built while
        the model runs; the runner waits for it before sampling)."""
        if self._grammars is None:
            return out  # no constrained request has ever come: nothing to look at
        if self._masks is None:
            self._masks = StepMasks(self._grammars.vocab_size,
                                    on_mask=self.observer.on_grammar_mask)
        requests = self.scheduler.requests
        mask = self._masks.start(out, lambda rid: requests[rid].grammar)
        return out if mask is None else dataclasses.replace(out, grammar_mask=mask)

    def _update(self, out: SchedulerOutput, result: RunnerOutput) -> None:
        # Aborts that arrived while the batch executed go out before its outputs.
        aborted = self._apply_aborts()
        updates = aborted + self.scheduler.update_from_output(out, result)
        self._emit(updates, self.kv_events.drain())

    def _wait_for_batches(self) -> None:
        """Let batches in flight finish (their outputs are dropped) before the scheduler's
        requests are torn down, so no forward pass outlives the loop."""
        while self._batch_queue:
            future, _ = self._batch_queue.popleft()
            try:
                future.result()
            except Exception:
                logger.exception("%s: a batch in flight failed during shutdown", self.name)

    # ---- utility calls (on the loop thread) -------------------------------------

    def _run_utility(self, call: UtilityCall) -> None:
        handler = self._utilities.get(call.method)
        if handler is None:
            known = ", ".join(sorted(self._utilities))
            reply = self._utility_reply(
                call, failure=f"unknown utility method {call.method!r} (known: {known})")
        else:
            try:
                reply = self._utility_reply(call, result=handler(call.args))
            except Exception as exc:
                # A failing utility is the caller's error, never the engine's death.
                logger.warning("%s: utility %r failed: %s", self.name, call.method, exc)
                reply = self._utility_reply(
                    call, failure=f"utility {call.method!r} failed on {self.name}: {exc}")
        # Through the output queue, so the reply follows the outputs emitted before it.
        self.output_queue.put(reply)

    @staticmethod
    def _utility_reply(call: UtilityCall, result: dict[str, Any] | None = None,
                       failure: str = "") -> UtilityReply:
        return UtilityReply(call.call_id, json.dumps(result) if result is not None else "",
                            failure, call.session_id)

    def _reset_prefix_cache(self, args: dict[str, Any]) -> dict[str, Any]:
        # As in vLLM: blocks held by running requests may be shared through their
        # hashes, so the cache is only reset when no request holds any.
        if self.scheduler.running:
            raise ValueError(
                f"{len(self.scheduler.running)} requests are running and hold KV blocks; "
                "pause (mode abort or wait) until none run, then reset")
        return {"num_blocks_dropped": self.scheduler.kv_cache.reset_prefix_cache()}

    def _get_stats(self, args: dict[str, Any]) -> dict[str, Any]:
        kv = self.scheduler.kv_cache
        stats = self.scheduler.stats()
        return {
            "engine_index": self.config.engine_index,
            "state": self._state.name,
            "paused": self._pause_mode.value if self._pause_mode else None,
            "num_running": stats.num_running,
            "num_waiting": stats.num_waiting,
            "kv_cache_usage": stats.kv_cache_usage,
            "num_blocks": kv.num_blocks,
            "num_free_blocks": kv.num_free_blocks,
            "num_cached_blocks": kv.pool.num_cached_blocks,
            "prefix_cache_queries": stats.prefix_cache_queries,
            "prefix_cache_hits": stats.prefix_cache_hits,
            "step_counter": stats.step_counter,
            **({"wave": self._wave.wave, "wave_running": self._wave.running,
                "dummy_steps": self._wave.num_dummy_steps} if self._wave is not None else {}),
        }

    def _pause(self, args: dict[str, Any]) -> dict[str, Any]:
        if self._state is not EngineState.RUNNING:
            raise ValueError(self._not_running_message())
        raw = args.get("mode", PauseMode.WAIT.value)
        try:
            mode = PauseMode(raw)
        except ValueError:
            choices = ", ".join(m.value for m in PauseMode)
            raise ValueError(f"unknown pause mode {raw!r} (choose {choices})") from None
        num_aborted = 0
        if mode is PauseMode.ABORT:
            aborted = self._finish_all(FinishReason.ABORT)
            num_aborted = len(aborted)
            self._emit(aborted)
        self._pause_mode = mode
        self.scheduler.admitting = False
        return {"mode": mode.value, "num_aborted": num_aborted,
                "num_running": len(self.scheduler.running),
                "num_waiting": len(self.scheduler.waiting)}

    def _resume(self, args: dict[str, Any]) -> dict[str, Any]:
        was = self._pause_mode
        self._pause_mode = None
        self.scheduler.admitting = True
        return {"was_paused": was.value if was else None}

    def _profile(self, args: dict[str, Any]) -> dict[str, Any]:
        action = args.get("action")
        if action not in ("start", "stop"):
            raise ValueError(f"profile action must be 'start' or 'stop', got {action!r}")
        if not hasattr(self.runner, "start_profile"):
            raise ValueError(f"the model runner {type(self.runner).__name__} cannot profile")
        if action == "stop":
            return self.runner.stop_profile()
        folder = Path(self.config.profile_dir or Path(tempfile.gettempdir()) /
                      "corestream-profiles")
        return self.runner.start_profile(folder, f"engine{self.config.engine_index}")

    def _apply_aborts(self) -> list[RequestUpdate]:
        updates: list[RequestUpdate] = []
        while True:
            try:
                request_ids = self.aborts_queue.get_nowait()
            except queue.Empty:
                return updates
            updates += self._abort(request_ids)

    def _publish_stats(self) -> None:
        self._stats = self.scheduler.stats()

    def _drain_over(self) -> bool:
        # A rank must not leave a running wave: the others' collectives need it.
        in_wave = self._wave is not None and self._wave.running
        return ((not self.scheduler.has_work() and not in_wave and not self._compiling)
                or time.monotonic() >= self._drain_deadline)

    # ---- endings ---------------------------------------------------------------

    def _stop(self) -> None:
        if self._watchdog is not None:
            self._watchdog.stop()
        self._wait_for_batches()
        if self._batch_queue is not None:
            self._executor.shutdown(wait=False)
        for pool in (self._grammars, self._masks):
            if pool is not None:
                pool.close()
        message = (f"{self.name} is shutting down; the request did not finish within the "
                   "drain timeout")
        unfinished = self._finish_all(FinishReason.ERROR, UNAVAILABLE, message)
        if unfinished:
            logger.warning("%s: aborted %d requests left after draining", self.name,
                           len(unfinished))
        self._emit(unfinished)
        self._set_state(EngineState.STOPPED)
        self._reject_pending_adds(f"{self.name} is shutting down")
        self._publish_stats()
        self._broadcast()

    def _on_watchdog_expired(self, silent_s: float) -> None:
        reason = (f"watchdog: the busy loop made no progress for {silent_s:.1f} s "
                  f"(limit {self.config.watchdog_timeout:g} s) with work pending")
        logger.critical("%s: %s; the stack of every thread follows", self.name, reason)
        faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
        # The stuck loop thread owns the scheduler: leave it alone; the Sessions end
        # the streams (see server.py).
        self._die(reason, fail_requests=False)

    def _die(self, reason: str, fail_requests: bool) -> None:
        """Mark the engine DEAD (once) and tell everyone; `fail_requests` only from the
        loop thread, the scheduler's owner."""
        with self._state_lock:
            if self._death_reason or self._state in (EngineState.DEAD, EngineState.STOPPED):
                return
            self._death_reason = reason
        self._set_state(EngineState.DEAD)
        if self._watchdog is not None:
            self._watchdog.stop()
        message = f"{self.name} is dead ({reason}); the request did not complete"
        logger.critical("%s is dead: %s\n%s", self.name, reason, self._describe_scheduler())
        if fail_requests:
            try:
                self._emit(self._finish_all(FinishReason.ERROR, UNAVAILABLE, message))
            except Exception:
                logger.exception("could not fail the requests of a dead engine")
        self._reject_pending_adds(message)
        self._broadcast()

    def _describe_scheduler(self) -> str:
        """The scheduler's state for the fatal log record (best effort: when the
        watchdog calls this, the loop thread may still be mutating it)."""
        try:
            stats = self.scheduler.stats()
            lines = [f"scheduler: {stats}"]
            for req in list(self.scheduler.requests.values()):
                lines.append(
                    f"  {req.request_id}: {req.status.name}, prompt {len(req.prompt_token_ids)}"
                    f" tokens, {len(req.output_token_ids)} generated, {req.num_computed_tokens}"
                    f" computed, {req.num_preemptions} preemptions")
            return "\n".join(lines)
        except Exception as exc:
            return f"scheduler state unavailable: {exc!r}"

    def _not_running_message(self) -> str:
        if self._state is EngineState.DRAINING:
            return f"{self.name} is draining and accepts no new requests"
        if self._state is EngineState.DEAD:
            return f"{self.name} is dead ({self._death_reason})"
        return f"{self.name} is {self._state.name.lower()}"

    def _reject_pending_adds(self, message: str) -> None:
        while True:
            try:
                kind, payload = self.input_queue.get_nowait()
            except queue.Empty:
                return
            if kind is InputType.ADD:
                self._reject([payload], UNAVAILABLE, message)
            elif kind is InputType.UTILITY:
                self.sessions.reply(self._utility_reply(
                    payload, failure=f"utility {payload.method!r} failed: {message}"))

    def _reject(self, requests: Iterable[Request], code: int, message: str) -> None:
        self._emit([
            RequestUpdate(r.request_id, r.session_id, finish_reason=FinishReason.ERROR,
                          error_code=code, error_message=message)
            for r in requests
        ])

    # ---- outputs ---------------------------------------------------------------

    def _emit(self, updates: list[RequestUpdate], kv_events: tuple[KvEvent, ...] = ()) -> None:
        """Queue one StepOutputs. `kv_events` only from the loop thread: the events'
        order on the output queue is their seq order (other threads emit too)."""
        if not updates and not kv_events:
            return
        if updates:
            self.observer.on_updates(updates)
        by_session: dict[str, list[RequestUpdate]] = {}
        for u in updates:
            by_session.setdefault(u.session_id, []).append(u)
        self.output_queue.put(StepOutputs(by_session, self.scheduler.stats(), self._state,
                                          time.time(), kv_events=kv_events))

    def _flush_kv_events(self) -> None:
        if self.kv_events.has_pending:
            self._emit([], self.kv_events.drain())

    def _subscribe_kv(self, session_id: str) -> None:
        self._flush_kv_events()
        kv = self.scheduler.kv_cache
        self.output_queue.put(KvSnapshot(session_id, self.kv_events.epoch,
                                         self.kv_events.last_seq, kv.block_size,
                                         kv.pool.cached_hashes()))

    def _broadcast(self) -> None:
        self.output_queue.put(StepOutputs({}, self.scheduler.stats(), self._state, time.time(),
                                          broadcast=True))

    def _set_state(self, state: EngineState) -> None:
        with self._state_lock:
            if self._state is EngineState.DEAD or self._state is state:
                return  # DEAD is final, whichever thread notices what next
            logger.info("%s: %s", self.name, state.name)
            self._state = state
        for listener in self._state_listeners:
            listener(state)

    def _run_output_loop(self) -> None:
        while (item := self.output_queue.get()) is not None:
            if isinstance(item, UtilityReply):
                self.sessions.reply(item)
            elif isinstance(item, KvSnapshot):
                self.sessions.subscribe_kv(item)
            else:
                self.sessions.route(item)
