"""The sentinel: a failed step pauses the engine, which keeps its requests, recovers
(re-forming its group) and resumes with the outputs of an uninterrupted run."""

from __future__ import annotations

import threading
import time
from typing import Any

import pytest

from services.engine.config import EngineConfig
from services.engine.core.engine_core import EngineCore
from services.engine.core.sentinel import RETRY_PAUSE_S
from services.engine.messages import EngineState, InputType, SessionOutputs
from services.engine.request import UNAVAILABLE, FinishReason
from services.engine.scheduler.output import RunnerOutput
from tests.unit.engine.fakes import (
    FakeRunner,
    LockstepRunner,
    call,
    collect,
    ok,
    request,
    tokens,
)


class FailingOnce(FakeRunner):
    """Raises in the execute after `at` successful ones, once (`times` in a row)."""

    def __init__(self, at: int, times: int = 1) -> None:
        super().__init__()
        self.at, self.left = at, times

    def execute(self, out):  # type: ignore[no-untyped-def]
        if self.steps == self.at and self.left:
            self.left -= 1
            raise RuntimeError("transient device error")
        return super().execute(out)


def run(runner: FakeRunner, config: EngineConfig | None = None,
        prompts: tuple[tuple[int, ...], ...] = ((1, 2, 3), (10, 20), (7,))
        ) -> tuple[EngineCore, dict[str, list[int]], list[EngineState]]:
    core = EngineCore(config or EngineConfig(), runner)
    states: list[EngineState] = []
    core.add_state_listener(states.append)
    q = core.sessions.open("s")
    core.start()
    try:
        for i, prompt in enumerate(prompts):
            core.add_request(request(f"r{i}", prompt=prompt, max_tokens=8))
        by_id, _ = collect(q, {f"r{i}" for i in range(len(prompts))})
        status = ok(call(core, q, "fault_status"))
    finally:
        core.shutdown()
    assert all(u.error_code == 0 for ups in by_id.values() for u in ups), by_id
    outputs = {rid: tokens(ups) for rid, ups in by_id.items()}
    core.test_status = status  # type: ignore[attr-defined]
    return core, outputs, states


@pytest.mark.timeout(60)
def test_a_transient_fault_pauses_and_resumes_with_the_same_outputs() -> None:
    _, want, _ = run(FakeRunner())
    core, got, states = run(FailingOnce(at=3, times=2))
    assert got == want
    assert states == [EngineState.RUNNING, EngineState.PAUSED_FAULT, EngineState.RUNNING,
                      EngineState.PAUSED_FAULT, EngineState.RUNNING, EngineState.DRAINING,
                      EngineState.STOPPED]
    status = core.test_status  # type: ignore[attr-defined]
    assert status["faults"] == 2 and status["in_a_row"] == 0
    assert "transient device error" in status["last_fault"]["reason"]


@pytest.mark.timeout(60)
def test_no_retries_with_max_step_faults_0() -> None:
    runner = FailingOnce(at=2)
    core = EngineCore(EngineConfig(max_step_faults=0), runner)
    q = core.sessions.open("s")
    core.start()
    try:
        core.add_request(request("r", max_tokens=8))
        by_id, _ = collect(q, {"r"})
        assert by_id["r"][-1].error_code == UNAVAILABLE
        assert core.state is EngineState.DEAD and "transient" in core.death_reason
    finally:
        core.shutdown()


class Unreformable(FakeRunner):
    """Fails one step, and re-forming its group always fails (a peer never returns):
    with `error`, TimeoutError by default (the group's store answers, a rank is
    missing). `shrinks`: once allowed to, it goes on without the missing rank."""

    def __init__(self, error: type[Exception] = TimeoutError, shrinks: bool = False) -> None:
        super().__init__()
        self.attempts = 0
        self.error = error
        self.shrinks = shrinks
        self.shrink_flags: list[bool] = []
        self.failed = False

    def execute(self, out):  # type: ignore[no-untyped-def]
        if self.steps == 2 and not self.failed:
            self.failed = True
            raise RuntimeError("peer gone")
        return super().execute(out)

    def reform_group(self, state: list[int], shrink: bool = False
                     ) -> tuple[int, list[list[int]]]:
        self.attempts += 1
        self.shrink_flags.append(shrink)
        if shrink and self.shrinks:
            return 1, [state]
        time.sleep(0.05)
        raise self.error("1 of 2 ranks are back" + (
            "; the ranks back cannot go on without the others: 8 experts over 3 ranks"
            if shrink else ""))


def faulting(recovery_timeout_s: float, runner: Unreformable | None = None
             ) -> tuple[EngineCore, Unreformable, Any]:
    """A started engine whose step fails and whose group never re-forms, with request
    "r" on Session "s" (returned: the core, its runner, the Session's queue)."""
    runner = runner or Unreformable()
    core = EngineCore(EngineConfig(engine_recovery_timeout_s=recovery_timeout_s), runner)
    q = core.sessions.open("s")
    core.start()
    core.add_request(request("r", max_tokens=8))
    return core, runner, q


@pytest.mark.timeout(60)
def test_paused_engine_answers_status_and_abort_ends_its_requests() -> None:
    core, runner, q = faulting(600)
    try:
        deadline = time.monotonic() + 10
        while core.state is not EngineState.PAUSED_FAULT:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        seen: list[SessionOutputs] = []
        status = ok(call(core, q, "fault_status", seen=seen))
        assert status["state"] == "PAUSED_FAULT" and status["faults"] == 1
        assert "peer gone" in status["last_fault"]["reason"]
        # Requests wait; a new one is refused (the frontend routes around the engine).
        core.add_request(request("late", max_tokens=2))
        by_id, _ = collect(q, {"late"})
        assert by_id["late"][-1].error_code == UNAVAILABLE
        assert ok(call(core, q, "fault_recover"))["state"] == "PAUSED_FAULT"
        before_reply: list[SessionOutputs] = []
        reply = call(core, q, "fault_abort", seen=before_reply)
        assert ok(reply)["state"] == "DEAD"
        # The requests ended (before the reply) as a dead engine's do.
        [last] = [u for msg in before_reply for u in msg.updates if u.request_id == "r"]
        assert last.finish_reason is FinishReason.ERROR and last.error_code == UNAVAILABLE
        assert "aborted by an operator" in last.error_message and runner.attempts >= 1
    finally:
        core.shutdown()


@pytest.mark.timeout(60)
def test_an_unreachable_group_gives_up_after_the_timeout() -> None:
    core, runner, q = faulting(0.5, Unreformable(ConnectionError))
    try:
        by_id, _ = collect(q, {"r"})
        assert by_id["r"][-1].error_code == UNAVAILABLE
        assert core.state is EngineState.DEAD
        assert "did not re-form within engine_recovery_timeout_s" in core.death_reason
        assert runner.attempts >= 1
    finally:
        core.shutdown()


@pytest.mark.timeout(60)
def test_past_the_timeout_the_group_goes_on_without_the_missing_rank() -> None:
    """The missing rank never comes: once the timeout passed, re-forming may leave it
    out, and the engine resumes its request with the tokens of a run without the fault."""
    _, want, _ = run(FakeRunner(), prompts=((1, 2, 3),))
    core, runner, q = faulting(0.3, Unreformable(shrinks=True))
    try:
        by_id, _ = collect(q, {"r"}, timeout=30)
        assert all(u.error_code == 0 for u in by_id["r"])
        assert tokens(by_id["r"]) == want["r0"]
        assert runner.shrink_flags[0] is False and runner.shrink_flags[-1] is True
        status = ok(call(core, q, "fault_status"))
        assert status["state"] == "RUNNING" and status["group_size"] == 1, status
    finally:
        core.shutdown()


@pytest.mark.timeout(60)
def test_a_group_that_cannot_go_on_smaller_waits_saying_why() -> None:
    """Past the timeout, with ranks that cannot serve the model without the missing
    one: the engine does not die, it waits paused, and its status says why."""
    core, runner, q = faulting(0.3)
    try:
        deadline = time.monotonic() + 20
        while True:
            status = ok(call(core, q, "fault_status"))
            if "the ranks back cannot go on without the others" in status["last_recovery_error"]:
                break
            assert time.monotonic() < deadline, status
            time.sleep(0.05)
        assert "8 experts over 3 ranks" in status["last_recovery_error"]
        time.sleep(RETRY_PAUSE_S + 0.5)  # and it goes on trying
        status = ok(call(core, q, "fault_status"))
        assert status["state"] == "PAUSED_FAULT" and core.state is EngineState.PAUSED_FAULT
        assert runner.attempts >= 2 and True in runner.shrink_flags
        assert ok(call(core, q, "fault_abort"))["state"] == "DEAD"
    finally:
        core.shutdown()


@pytest.mark.timeout(60)
def test_a_rank_whose_step_fails_and_its_peer_recover_together() -> None:
    """Two lockstep ranks: rank 0's step raises; rank 1 waits for it at the barrier,
    times out, fails too. Both pause, re-form, agree on the wave and resume: every
    request's tokens are those of a run without the fault."""
    barrier, votes = threading.Barrier(2), [False, False]
    runners = [LockstepRunner(barrier, votes, r, timeout_s=0.5) for r in range(2)]
    runners[0].fail_once_at = 4
    cores = [EngineCore(EngineConfig(engine_index=r), runners[r]) for r in range(2)]
    states: list[list[EngineState]] = [[], []]

    def announce(wave: int) -> None:
        for core in cores:
            core.start_wave(wave)

    queues = []
    for r, core in enumerate(cores):
        core.add_state_listener(states[r].append)
        core.join_waves(check_interval=4, announce=announce)
        queues.append(core.sessions.open("s"))
        core.start()
    try:
        cores[0].add_request(request("a", max_tokens=10))
        cores[1].add_request(request("b", prompt=(50, 51), max_tokens=12))
        got = {}
        for q, rid in zip(queues, ("a", "b"), strict=True):
            by_id, _ = collect(q, {rid}, timeout=30)
            assert all(u.error_code == 0 for u in by_id[rid])
            got[rid] = tokens(by_id[rid])
        assert got == {"a": list(range(4, 14)), "b": list(range(52, 64))}
        for r in (0, 1):
            assert states[r][:3] == [EngineState.RUNNING, EngineState.PAUSED_FAULT,
                                     EngineState.RUNNING], states[r]
            assert runners[r].reformed == [1]
            assert ok(call(cores[r], queues[r], "fault_status"))["epoch"] == 1
        # Still in lockstep: the wave ends on both ranks together.
        deadline = time.monotonic() + 10
        while any(c.wave is not None and c.wave.running for c in cores):
            assert time.monotonic() < deadline, "the wave did not end"
            time.sleep(0.01)
        assert cores[0].wave is not None and cores[1].wave is not None
        assert cores[0].wave.wave == cores[1].wave.wave
    finally:
        for core in cores:
            threading.Thread(target=core.shutdown, daemon=True).start()
        time.sleep(0.5)
        barrier.abort()


class FailingWhenDraining(FakeRunner):
    """Its 4th step waits until the engine drains, then raises."""

    def __init__(self) -> None:
        super().__init__()
        self.draining = threading.Event()

    def execute(self, out):  # type: ignore[no-untyped-def]
        if self.steps == 3:
            assert self.draining.wait(10)
            raise RuntimeError("device lost while draining")
        return super().execute(out)


@pytest.mark.timeout(60)
def test_a_fault_while_draining_is_fatal_as_before() -> None:
    runner = FailingWhenDraining()
    runner.delay_s = 0.05
    core = EngineCore(EngineConfig(), runner)
    states: list[EngineState] = []
    core.add_state_listener(states.append)
    core.add_state_listener(
        lambda state: runner.draining.set() if state is EngineState.DRAINING else None)
    q = core.sessions.open("s")
    core.start()
    try:
        core.add_request(request("r", max_tokens=8))
        # What shutdown() sends, queued right behind the add: the drain begins within
        # the request's first steps (each takes 50 ms), before its 4th.
        core.input_queue.put((InputType.SHUTDOWN, 30.0))
        by_id, _ = collect(q, {"r"})
        assert by_id["r"][-1].error_code == UNAVAILABLE
        assert EngineState.PAUSED_FAULT not in states and states[-1] is EngineState.DEAD
    finally:
        core.shutdown()


class LosingTokens(FakeRunner):
    """Returns no token for the requests that sample: the update raises (a bug)."""

    def execute(self, out):  # type: ignore[no-untyped-def]
        self.steps += 1
        return RunnerOutput()


@pytest.mark.timeout(60)
def test_a_failed_update_is_fatal_not_retried() -> None:
    core = EngineCore(EngineConfig(), LosingTokens())
    states: list[EngineState] = []
    core.add_state_listener(states.append)
    q = core.sessions.open("s")
    core.start()
    try:
        core.add_request(request("r", max_tokens=4))
        by_id, _ = collect(q, {"r"})
        assert by_id["r"][-1].error_code == UNAVAILABLE
        assert states == [EngineState.RUNNING, EngineState.DEAD]
        assert core.death_reason.startswith("KeyError")
    finally:
        core.shutdown()
