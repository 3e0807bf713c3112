"""GrammarCompiles: constrained requests waiting for their grammars, and the step masks.

A request with an output constraint first waits here, outside the scheduler, while
its grammar compiles on the compiler's pool (structured/), so it holds back
nobody; the result comes back to the loop as an input item (`on_done`), and a
compile past grammar_compile_timeout_s fails only that request. After each
schedule() the token bitmask of the step's constrained rows starts building on the
mask thread; the executor waits for it after the forward pass, before sampling.
Everything here runs on the loop thread, except the pools' own work.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Iterable
from concurrent.futures import Future
from dataclasses import dataclass

from services.common.model_info import ModelInfo
from services.engine.config import EngineConfig
from services.engine.core.emitter import OutputEmitter
from services.engine.core.observer import EngineObserver
from services.engine.request import INVALID_ARGUMENT, FinishReason, Request, RequestUpdate
from services.engine.scheduler.output import SchedulerOutput
from services.engine.scheduler.scheduler import RequestRejected, Scheduler
from services.engine.structured.compiler import Compiled, GrammarCompiler
from services.engine.structured.step_mask import StepMasks


@dataclass(slots=True)
class _Compiling:
    request: Request
    future: Future[Compiled]
    deadline: float
    """time.monotonic() past which the compile has failed."""
    started: float
    """time.time() when it started, for the trace."""


class GrammarCompiles:
    def __init__(self, config: EngineConfig, model_info: ModelInfo, scheduler: Scheduler,
                 outputs: OutputEmitter, on_done: Callable[[str], None]) -> None:
        """`on_done(request_id)` is called on a pool thread when a compile ends; the
        loop then calls `ready`."""
        self._config = config
        self._model_info = model_info
        self._scheduler = scheduler
        self._outputs = outputs
        self._on_done = on_done
        self.observer = EngineObserver()
        # Both started on the first constrained request.
        self.compiler: GrammarCompiler | None = None
        self._masks: StepMasks | None = None
        self._pending: dict[str, _Compiling] = {}

    def __len__(self) -> int:
        return len(self._pending)

    def start(self, request: Request) -> None:
        constraint = request.sampling.constraint
        assert constraint is not None
        rid = request.request_id
        if rid in self._pending:
            self._outputs.reject([request], INVALID_ARGUMENT,
                                 f"request id {rid!r} is already in use")
            return
        try:
            # Fail what can never run now (a duplicate id too), not after its compile.
            self._scheduler.check_admissible(request)
        except RequestRejected as exc:
            self._outputs.reject([request], INVALID_ARGUMENT, str(exc))
            return
        if self.compiler is None:
            self.compiler = GrammarCompiler(self._model_info,
                                            self._config.grammar_compile_workers,
                                            self._config.grammar_cache_size)
        future = self.compiler.compile(constraint)
        self._pending[rid] = _Compiling(
            request, future, time.monotonic() + self._config.grammar_compile_timeout_s,
            time.time())
        # The loop may be blocked on input: the result must come to it as input.
        future.add_done_callback(lambda _: self._on_done(rid))

    def ready(self, request_id: str) -> Request | None:
        """The request whose grammar compiled, ready for the scheduler; None if it
        failed (and was rejected), was aborted or timed out meanwhile."""
        pending = self._pending.pop(request_id, None)
        if pending is None:
            return None
        request = pending.request
        try:
            compiled = pending.future.result()
        except Exception as exc:
            self._outputs.reject([request], INVALID_ARGUMENT, str(exc))
            return None
        request.grammar = compiled.grammar
        request.grammar_compile = (pending.started, time.time())
        self.observer.on_grammar_compiled(compiled.seconds, compiled.cached)
        return request

    def wait_s(self, drain_deadline: float | None) -> float | None:
        """How long the loop may block on input before a deadline passes."""
        if not self._pending:
            return None
        first = min(p.deadline for p in self._pending.values())
        if drain_deadline is not None:
            first = min(first, drain_deadline)
        return max(first - time.monotonic(), 0.0)

    def expire(self) -> None:
        now = time.monotonic()
        expired = [p for p in self._pending.values() if p.deadline <= now]
        for pending in expired:
            del self._pending[pending.request.request_id]
            pending.future.cancel()
            constraint = pending.request.sampling.constraint
            assert constraint is not None
            self._outputs.reject([pending.request], INVALID_ARGUMENT, (
                f"{constraint.field}: compiling it took longer than this engine's "
                f"grammar_compile_timeout_s ({self._config.grammar_compile_timeout_s:g} s); "
                "simplify the constraint"))

    def abort(self, request_ids: Iterable[str]) -> list[RequestUpdate]:
        updates = []
        for rid in request_ids:
            pending = self._pending.pop(rid, None)
            if pending is not None:
                pending.future.cancel()
                updates.append(RequestUpdate(rid, pending.request.session_id,
                                             finish_reason=FinishReason.ABORT))
        return updates

    def finish_all(self, reason: FinishReason, error_code: int = 0,
                   error_message: str = "") -> list[RequestUpdate]:
        pending, self._pending = list(self._pending.values()), {}
        for p in pending:
            p.future.cancel()
        return [RequestUpdate(p.request.request_id, p.request.session_id,
                              finish_reason=reason, error_code=error_code,
                              error_message=error_message) for p in pending]

    def with_grammar_mask(self, out: SchedulerOutput) -> SchedulerOutput:
        """Start building the token mask of `out`'s constrained rows (it is built while
        the model runs; the executor waits for it before sampling)."""
        if self.compiler is None:
            return out  # no constrained request has ever come: nothing to look at
        if self._masks is None:
            self._masks = StepMasks(self.compiler.vocab_size,
                                    on_mask=self.observer.on_grammar_mask)
        requests = self._scheduler.requests
        mask = self._masks.start(out, lambda rid: requests[rid].grammar)
        return out if mask is None else dataclasses.replace(out, grammar_mask=mask)

    def close(self) -> None:
        for pool in (self.compiler, self._masks):
            if pool is not None:
                pool.close()
