"""EngineCore in lockstep waves: two cores in one process whose runners meet at a
barrier on every forward pass and all-reduce, as expert-parallel ranks do."""

from __future__ import annotations

import threading
import time

import pytest

from services.engine.config import EngineConfig
from services.engine.core.engine_core import EngineCore
from services.engine.request import FinishReason
from services.engine.scheduler.output import RunnerOutput, SchedulerOutput
from tests.unit.engine.fakes import FakeRunner, collect, request, tokens


class LockstepRunner(FakeRunner):
    """A FakeRunner whose every forward (real or dummy) and every all-reduce waits for
    all ranks, so a rank that stepped alone would hang the test (the barrier times out)."""

    def __init__(self, barrier: threading.Barrier, votes: list[bool], rank: int) -> None:
        super().__init__()
        self.barrier, self.votes, self.rank = barrier, votes, rank
        self.dummy_steps = 0

    def execute(self, out: SchedulerOutput) -> RunnerOutput:
        self.barrier.wait(10)
        return super().execute(out)

    def execute_dummy(self) -> None:
        self.dummy_steps += 1
        self.barrier.wait(10)

    def any_rank_has_work(self, has_work: bool) -> bool:
        self.votes[self.rank] = has_work
        self.barrier.wait(10)
        result = any(self.votes)
        self.barrier.wait(10)  # nobody votes again before everyone has read
        return result


@pytest.mark.timeout(60)
def test_idle_rank_runs_dummies_until_the_wave_ends_then_both_idle() -> None:
    barrier, votes = threading.Barrier(2), [False, False]
    runners = [LockstepRunner(barrier, votes, r) for r in range(2)]
    cores = [EngineCore(EngineConfig(engine_index=r), runners[r]) for r in range(2)]
    announced: list[tuple[int, int]] = []

    def relay(sender: int) -> object:
        def announce(wave: int) -> None:  # the coordinator's job, in miniature
            announced.append((sender, wave))
            for core in cores:
                core.start_wave(wave)
        return announce

    for r, core in enumerate(cores):
        core.join_waves(check_interval=4, announce=relay(r))  # type: ignore[arg-type]
    q = cores[0].sessions.open("s")
    for core in cores:
        core.start()
    try:
        cores[0].add_request(request("a", max_tokens=6))
        by_id, _ = collect(q, {"a"})
        assert tokens(by_id["a"]) == [4, 5, 6, 7, 8, 9]
        waves = [c.wave for c in cores]
        deadline = time.monotonic() + 10
        while any(w is not None and w.running for w in waves):
            assert time.monotonic() < deadline, "the wave did not end"
            time.sleep(0.01)
        assert all(w is not None and w.wave == 1 for w in waves)
        assert announced == [(0, 0)]
        assert runners[1].dummy_steps >= 6 and runners[1].steps == 0
        # Idle: nothing steps any more (no spinning).
        counts = [(r.steps, r.dummy_steps) for r in runners]
        time.sleep(0.3)
        assert [(r.steps, r.dummy_steps) for r in runners] == counts
        # A request at the other rank starts the next wave everywhere.
        q1 = cores[1].sessions.open("t")
        cores[1].add_request(request("b", "t", max_tokens=2))
        by_id, _ = collect(q1, {"b"})
        assert by_id["b"][-1].finish_reason is FinishReason.LENGTH
        assert announced == [(0, 0), (1, 1)]
        assert runners[0].dummy_steps > counts[0][1]
    finally:
        barrier.abort()  # release a rank stuck at the barrier when the test fails
        for core in cores:
            core.shutdown()
