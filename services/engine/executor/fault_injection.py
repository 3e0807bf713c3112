"""Test-only fault injection around the model runner's execute.

Failure-path tests need an engine that fails the way real ones do (an exception in
the forward pass, a device call that never returns) inside real processes started
by `corestream serve`. The environment variable `CORESTREAM_FAULT_INJECT`, read
once at engine start, arms one fault:

    raise_after_steps:N[@I]   the execute after N successful ones raises (and every
                              later one: a fault that does not go away)
    raise_once_after_steps:N[@I]  the execute after N successful ones raises, once (a
                              transient fault: the engine's sentinel recovers from it)
    hang_after_steps:N[@I]    the execute after N successful ones never returns
    worker_raise_after_steps:N[@I]  with --tensor-parallel-size > 1: the last worker
                              raises in the forward after N (its own process fails)
    worker_hang_after_steps:N[@I]   ... the last worker's forward never returns
    crash_at_start[@I]        the engine exits with code 1 once its model is loaded,
                              before it serves (every start: a crash loop for serve)
    slow_steps:MS[@I]         every execute takes at least MS milliseconds (a slow
                              device: a floor on how long N tokens take, whatever the CPU)
    raise_on_sigusr2[@I]      each SIGUSR2 the engine process gets makes its next
                              execute raise, once (a transient fault at a moment the
                              test chooses: the soak's seeded schedule)

`@I` limits the fault to the engine with engine_index I (all engines otherwise).
Never set it in production; the engine logs a warning when a fault is armed.
"""

from __future__ import annotations

import logging
import signal
import threading
import time
from dataclasses import dataclass

from services.engine.executor.protocol import Executor
from services.engine.scheduler.output import RunnerOutput, SchedulerOutput

logger = logging.getLogger(__name__)

ENV_VAR = "CORESTREAM_FAULT_INJECT"
KINDS = ("raise_after_steps", "raise_once_after_steps", "hang_after_steps", "crash_at_start",
         "worker_raise_after_steps", "worker_hang_after_steps", "slow_steps",
         "raise_on_sigusr2")
# Kinds that take no step count.
UNCOUNTED = ("crash_at_start", "raise_on_sigusr2")
WORKER_KINDS = ("worker_raise_after_steps", "worker_hang_after_steps")


class InjectedFault(RuntimeError):
    pass


@dataclass(frozen=True)
class FaultSpec:
    kind: str
    after_steps: int
    engine_index: int | None = None

    @classmethod
    def parse(cls, text: str) -> FaultSpec:
        spec, _, index = text.partition("@")
        kind, _, steps = spec.partition(":")
        if kind in UNCOUNTED and not steps:
            steps = "0"
        if kind not in KINDS or not steps.isdigit() or (index and not index.isdigit()):
            raise ValueError(
                f"{ENV_VAR} must be KIND:N[@ENGINE_INDEX] with KIND one of {KINDS}, got {text!r}"
            )
        return cls(kind, int(steps), int(index) if index else None)

    def applies_to(self, engine_index: int) -> bool:
        return self.engine_index is None or self.engine_index == engine_index


class FaultInjectingRunner:
    """The runner, with the fault of `spec` armed in `execute`."""

    def __init__(self, runner: Executor, spec: FaultSpec) -> None:
        self._runner = runner
        self._spec = spec
        self._steps = 0
        self._raised = False
        self._signalled = threading.Event()
        if spec.kind == "raise_on_sigusr2":
            # The handler runs on the main thread between bytecodes; the loop thread
            # sees the event at its next execute.
            signal.signal(signal.SIGUSR2, lambda *_: self._signalled.set())

    def __getattr__(self, name: str) -> object:
        # Everything but execute goes to the runner, and what it lacks (an optional
        # member such as start_profile) the wrapper lacks too.
        return getattr(self._runner, name)

    def execute(self, out: SchedulerOutput) -> RunnerOutput:
        if self._spec.kind == "slow_steps":
            time.sleep(self._spec.after_steps / 1000)
            return self._runner.execute(out)
        if self._spec.kind == "raise_on_sigusr2":
            if self._signalled.is_set():
                self._signalled.clear()
                raise InjectedFault("injected fault on SIGUSR2 (once)")
            return self._runner.execute(out)
        if self._steps >= self._spec.after_steps:
            if self._spec.kind == "raise_after_steps":
                raise InjectedFault(f"injected fault after {self._steps} steps")
            if self._spec.kind == "raise_once_after_steps":
                if not self._raised:
                    self._raised = True
                    raise InjectedFault(f"injected fault after {self._steps} steps (once)")
                self._steps += 1
                return self._runner.execute(out)
            logger.warning("injected hang after %d steps", self._steps)
            threading.Event().wait()  # never set: a device call that never returns
        self._steps += 1
        return self._runner.execute(out)


def worker_fault(env_value: str | None, engine_index: int) -> FaultSpec | None:
    """The fault a tensor-parallel worker of this engine arms, if any."""
    if not env_value:
        return None
    spec = FaultSpec.parse(env_value)
    if spec.kind not in WORKER_KINDS or not spec.applies_to(engine_index):
        return None
    logger.warning("TEST-ONLY fault injection armed in a worker: %s", spec)
    return spec


def maybe_inject(runner: Executor, env_value: str | None, engine_index: int) -> Executor:
    """`runner` wrapped when `env_value` (the env var's value) arms a fault for this engine."""
    if not env_value:
        return runner
    spec = FaultSpec.parse(env_value)
    if not spec.applies_to(engine_index) or spec.kind in WORKER_KINDS:
        return runner
    logger.warning("TEST-ONLY fault injection armed: %s", spec)
    if spec.kind == "crash_at_start":
        raise SystemExit(f"injected crash at start ({ENV_VAR}={env_value})")
    return FaultInjectingRunner(runner, spec)
