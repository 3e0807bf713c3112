"""Sentinel: a failed step pauses the engine instead of killing it.

A step can fail without anything being wrong with the engine's state: a peer of its
expert-parallel group died or froze (the group's collective raises), or a transient
error hit one forward. Killing the engine for that throws away its weights (minutes to
load on a large model), its KV cache and every request it holds. So the busy loop hands
a step's exception here, and the sentinel:

1. takes the failed step back (`Scheduler.unschedule`: its tokens were never computed,
   as far as the scheduler knows; what the forward wrote into the KV cache is written
   again, with the same values, when the step reruns);
2. pauses the engine (PAUSED_FAULT: readiness NOT_SERVING, the frontend routes nothing
   new to it, requests stay where they are, health and `get_stats` say why);
3. recovers on a thread of its own while the loop keeps answering calls: it re-forms the
   group under a new epoch (every live rank does the same; see
   `parallel.collectives.Collectives.reform`), the ranks agree on their lockstep wave
   state, and the engine resumes where it stopped: the same requests, the same outputs
   as without the fault.

Recovery is automatic and retried while the missing ranks may still come back (a
replacement that serve or Kubernetes starts). Once `engine_recovery_timeout_s` has passed
since the fault, the group may go on without them: the first rank re-forms it with the
ranks that are back, if they can hold every expert between them (each then loads from
the checkpoint the experts it owns in the smaller group, and keeps the rest of its
state); if they cannot, the ranks wait on, saying why (`fault_status`, logs), until a
replacement comes or an operator gives up. A rank that the group went on without dies
when it comes back (`LeftOut`), and so does a rank whose group's store is gone past the
timeout (the first rank died: the whole group restarts). A step that keeps failing after
recoveries (more than `max_step_faults` in a row) is no transient fault: the engine dies
then too. `fault_status`, `fault_recover` (try again now) and `fault_abort`
(give up now) are utility calls (AdminService, `corestream admin fault`).

Plain Python: the executor re-forms the group (`Executor.reform_group`).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from services.engine.core.emitter import OutputEmitter
from services.engine.core.lifecycle import Lifecycle
from services.engine.executor.protocol import Executor
from services.engine.messages import EngineState
from services.engine.parallel.errors import LeftOut
from services.engine.scheduler.output import SchedulerOutput
from services.engine.scheduler.scheduler import Scheduler
from services.engine.waves.state import WaveState

logger = logging.getLogger(__name__)

RETRY_PAUSE_S = 1.0
"""Between two failed attempts to re-form the group."""


@dataclass
class Fault:
    reason: str
    at: float
    """time.time() of the failure."""
    step: int
    """The scheduler's step counter when it failed."""


class Sentinel:
    def __init__(self, name: str, max_step_faults: int, recovery_timeout_s: float,
                 lifecycle: Lifecycle, scheduler: Scheduler, outputs: OutputEmitter,
                 executor: Executor, post: Callable[[Callable[[], None]], None],
                 wave: Callable[[], WaveState | None]) -> None:
        """`post(fn)` runs fn on the loop thread; `wave()` is the engine's wave state
        (None outside an expert-parallel group)."""
        self._name = name
        self._max_step_faults = max_step_faults
        self._recovery_timeout_s = recovery_timeout_s
        self._lifecycle = lifecycle
        self._scheduler = scheduler
        self._outputs = outputs
        self._executor = executor
        self._post = post
        self._wave = wave
        self.faults: list[Fault] = []
        self.halted = False
        """No step may run: a fault paused the engine and it has not resumed (also
        while it shuts down from that pause)."""
        self._in_a_row = 0
        self._recovering = False
        self._attempts = 0
        self.epoch = 0
        self.group_size: int | None = None
        """Ranks in the group as last re-formed (None before any re-forming)."""
        self.last_error = ""
        """Why the latest recovery attempt failed."""

    @property
    def paused(self) -> bool:
        return self._lifecycle.state is EngineState.PAUSED_FAULT

    def stepped(self) -> None:
        """A step succeeded: faults before it were transient."""
        self._in_a_row = 0

    def on_step_fault(self, exc: BaseException, failed: SchedulerOutput | None) -> bool:
        """The step that ran `failed` (None: no batch of this engine's, e.g. a wave's
        dummy step or its all-reduce) raised `exc`. True: the engine pauses and
        recovers; False: it must die (the caller re-raises)."""
        if getattr(exc, "fatal", False):
            return False  # the engine lost a part of itself (a TP worker): no re-forming helps
        if failed is not None:
            self._scheduler.unschedule(failed)
        self._in_a_row += 1
        fault = Fault(f"{type(exc).__name__}: {exc}", time.time(),
                      self._scheduler.step_counter)
        self.faults.append(fault)
        if self._in_a_row > self._max_step_faults:
            logger.error("%s: step failed %d times in a row (max_step_faults %d): %s",
                         self._name, self._in_a_row, self._max_step_faults, fault.reason)
            return False
        if self._lifecycle.state is not EngineState.RUNNING:
            return False  # draining: it is going anyway, and must not come back RUNNING
        logger.warning("%s: step %d failed (%s); pausing with %d requests kept, recovering",
                       self._name, fault.step, fault.reason, len(self._scheduler.requests))
        self.halted = True
        self._lifecycle.set_state(EngineState.PAUSED_FAULT)
        self._outputs.broadcast()
        self._attempts = 0
        self._start_recovery()
        return True

    # ---- recovery (the loop thread starts it; a thread of its own re-forms) ----------

    def _start_recovery(self) -> None:
        if self._recovering:
            return
        self._recovering = True
        wave = self._wave()
        state = [wave.wave, wave.steps, int(wave.running)] if wave is not None else [0, 0, 0]
        threading.Thread(target=self._recover, args=(state,), name="engine-sentinel",
                         daemon=True).start()

    def _recover(self, wave_state: list[int]) -> None:
        self._attempts += 1
        # Past the timeout the missing ranks had their chance: the group may go on
        # without them.
        shrink = time.time() - self.faults[-1].at >= self._recovery_timeout_s
        try:
            reform = getattr(self._executor, "reform_group", None)
            epoch, states = (reform(wave_state, shrink=shrink) if reform is not None
                             else (0, [wave_state]))
        except (NotImplementedError, LeftOut) as exc:
            # No retry can help: die at once, as before the sentinel.
            reason = f"{self.faults[-1].reason}; the group cannot be re-formed: {exc}"
            self._post(lambda: self._lifecycle.die(reason, fail_requests=True))
            return
        except Exception as exc:
            error = f"{type(exc).__name__}: {exc}"
            incomplete = isinstance(exc, TimeoutError)
            self._post(lambda: self._attempt_failed(error, incomplete))
            return
        self._post(lambda: self._resume(epoch, states))

    def _attempt_failed(self, error: str, incomplete: bool) -> None:
        """On the loop thread. `incomplete`: the group's store answered, but ranks were
        missing (and, past the timeout, the others could not go on without them)."""
        self._recovering = False
        self.last_error = error
        if not self.paused:
            return  # aborted meanwhile
        waited = time.time() - self.faults[-1].at
        if waited >= self._recovery_timeout_s and not incomplete:
            self._lifecycle.die(
                f"the group did not re-form within engine_recovery_timeout_s "
                f"{self._recovery_timeout_s:g} after {self.faults[-1].reason} ({error})",
                fail_requests=True)
            return
        logger.warning("%s: re-forming the group failed (attempt %d, %.0f s%s): %s",
                       self._name, self._attempts, waited,
                       f" of {self._recovery_timeout_s:g}"
                       if waited < self._recovery_timeout_s else
                       ", past engine_recovery_timeout_s; waiting on", error)
        threading.Timer(RETRY_PAUSE_S, lambda: self._post(self._retry)).start()

    def _retry(self) -> None:
        if self.paused:
            self._start_recovery()

    def _resume(self, epoch: int, states: list[list[int]]) -> None:
        """On the loop thread: the group re-formed; agree on the wave and run again."""
        self._recovering = False
        if not self.paused:
            return
        self._agree(epoch, states)
        logger.warning("%s: recovered under epoch %d (%d ranks) after %.2f s; resuming %d "
                       "requests", self._name, epoch, len(states),
                       time.time() - self.faults[-1].at, len(self._scheduler.requests))
        self.halted = False
        self._lifecycle.set_state(EngineState.RUNNING)
        self._outputs.broadcast()

    def _agree(self, epoch: int, states: list[list[int]]) -> None:
        self.epoch = epoch
        self.group_size = len(states)
        wave = self._wave()
        if wave is not None:
            # Every rank computes the same from the same gathered states. A rank that
            # finished the failed step before the others failed theirs is a step ahead:
            # all take the furthest, so the check intervals and admissions line up. (A
            # replacement brings zeros.)
            wave.wave = max(s[0] for s in states)
            wave.steps = max(s[1] for s in states)
            wave.running = any(s[2] for s in states)

    def join_reformed_group(self) -> None:
        """This engine replaces a failed rank of its group (before its loop starts):
        wait until the others take it in, then share their wave state."""
        logger.warning("%s: replacing a failed rank; waiting for the group to take it in",
                       self._name)
        deadline = time.monotonic() + self._recovery_timeout_s
        while True:
            try:
                epoch, states = self._executor.reform_group([0, 0, 0], shrink=False)
                break
            except TimeoutError:
                if time.monotonic() >= deadline:
                    raise
        self._agree(epoch, states)
        logger.warning("%s: joined the group under epoch %d", self._name, epoch)

    # ---- utility calls ---------------------------------------------------------------

    def status(self, args: dict[str, Any]) -> dict[str, Any]:
        last = self.faults[-1] if self.faults else None
        return {
            "state": self._lifecycle.state.name,
            "faults": len(self.faults),
            "in_a_row": self._in_a_row,
            "epoch": self.epoch,
            "group_size": self.group_size,
            "recovering": self._recovering,
            "recovery_attempts": self._attempts,
            "last_fault": None if last is None else
            {"reason": last.reason, "at": last.at, "step": last.step},
            "last_recovery_error": self.last_error,
        }

    def recover(self, args: dict[str, Any]) -> dict[str, Any]:
        if not self.paused:
            raise ValueError(f"{self._name} is {self._lifecycle.state.name}, not paused "
                             "by a fault: nothing to recover")
        self._start_recovery()
        return self.status(args)

    def abort(self, args: dict[str, Any]) -> dict[str, Any]:
        if not self.paused:
            raise ValueError(f"{self._name} is {self._lifecycle.state.name}, not paused "
                             "by a fault: nothing to abort")
        reason = self.faults[-1].reason if self.faults else "a fault"
        self._lifecycle.die(f"recovery aborted by an operator after {reason}",
                            fail_requests=True)
        return {"state": self._lifecycle.state.name}
