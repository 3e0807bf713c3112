"""WaveStepper: how an expert-parallel rank steps, in lockstep waves with the others.

Every MoE layer's collectives need every rank (waves/state.py says when a wave starts and
ends). While a wave runs this rank steps every loop iteration: a real batch when
the scheduler has one, a dummy forward otherwise; every check interval the ranks
all-reduce whether any still has work. A rank runs one batch at a time here, so the
batch queue is never used with waves.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from services.engine.executor.protocol import Executor
from services.engine.scheduler.output import RunnerOutput, SchedulerOutput
from services.engine.waves.state import WaveState

logger = logging.getLogger(__name__)


class WaveStepper:
    def __init__(self, check_interval: int, announce: Callable[[int], None] | None,
                 executor: Executor, name: str, prefill_interval: int = 1) -> None:
        """`announce(wave)` asks the coordinator to start `wave` on the other ranks;
        new requests start only every `prefill_interval` steps of a wave."""
        self.state = WaveState(check_interval, prefill_interval)
        self._announce = announce
        self._executor = executor
        self._name = name

    @property
    def running(self) -> bool:
        return self.state.running

    def join(self, wave: int) -> None:
        """Another rank started `wave` (relayed by the coordinator); stale ones are ignored."""
        if self.state.start(wave):
            logger.debug("%s: joined wave %d", self._name, wave)

    def step(self, schedule: Callable[[bool], SchedulerOutput | None],
             update: Callable[[SchedulerOutput, RunnerOutput], None],
             has_work: Callable[[], bool]) -> None:
        """One lockstep step: execute the batch from `schedule(admit)` (`admit`: whether
        new requests may start in this step) and `update` with its outputs, or execute
        a dummy batch when there is none, so that the MoE collectives line up."""
        wave = self.state
        if not wave.running and wave.start_local() and self._announce is not None:
            self._announce(wave.wave)
        out = schedule(wave.admits)
        if out is None:
            self._executor.execute_dummy()
        else:
            update(out, self._executor.execute(out))
        if wave.stepped(out is None) and wave.agreed(self._executor.any_rank_has_work(has_work())):
            logger.info("%s: wave %d ended; idle until new work", self._name, wave.wave - 1)
