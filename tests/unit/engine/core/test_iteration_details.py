"""Iteration details: each step's work and phase times, only for those who asked."""

from __future__ import annotations

import queue
from typing import Any

from services.common.sampling import SamplingParams
from services.engine.config import EngineConfig
from services.engine.core.engine_core import EngineCore
from services.engine.core.iteration_details import (
    RECENT_STEPS,
    IterationDetails,
    IterationRecorder,
    StepClock,
)
from services.engine.messages import SessionItem, SessionOutputs
from services.engine.scheduler.output import RunnerOutput, ScheduledRequest, SchedulerOutput
from tests.unit.engine.fakes import FakeRunner, call, ok, request, tiny_runner_for_tests


def drain(q: queue.SimpleQueue[SessionItem], finished: str,
          details_after: bool = True) -> list[SessionItem]:
    """Items until `finished` ends (and the details of that last step, if wanted)."""
    items: list[SessionItem] = []
    done = False
    while not done:
        item = q.get(timeout=10)
        items.append(item)
        if isinstance(item, SessionOutputs):
            done = any(u.request_id == finished and u.finished for u in item.updates)
    if details_after:
        items.append(q.get(timeout=10))
    return items


def started(config: EngineConfig | None = None) -> EngineCore:
    core = EngineCore(config or EngineConfig(), FakeRunner())
    core.start()
    return core


def test_a_session_that_asked_gets_each_steps_details_after_its_outputs() -> None:
    core = started()
    try:
        q = core.sessions.open("s")
        core.sessions.subscribe_details("s")
        core.add_request(request("a", prompt=(1, 2, 3, 4, 5), max_tokens=3))
        items = drain(q, "a")
        # Outputs, then that step's details, step after step.
        kinds = [type(i).__name__ for i in items]
        assert kinds == ["SessionOutputs", "IterationDetails"] * 3
        details = [i for i in items if isinstance(i, IterationDetails)]
        assert [(d.num_requests, d.num_tokens, d.num_prefill_requests, d.num_prefill_tokens,
                 d.num_decode_requests) for d in details] == [
            (1, 5, 1, 5, 0), (1, 1, 0, 0, 1), (1, 1, 0, 0, 1)]
        steps = [d.step for d in details]
        assert steps == sorted(steps) and len(set(steps)) == 3
        assert all(d.wave is None and d.wave_step is None for d in details)
        assert all(d.schedule_s > 0 and d.update_s > 0 for d in details)
        assert all(d.started_at > 0 for d in details)
        # The stats keep them while they are recorded.
        summary = ok(call(core, q, "get_stats"))["iteration_details"]
        assert summary["steps"] == 3 and summary["totals"]["num_tokens"] == 7
        assert [r["step"] for r in summary["recent"]] == steps
    finally:
        core.shutdown()


def test_a_session_that_did_not_ask_gets_none() -> None:
    core = started()
    try:
        asking, other = core.sessions.open("s"), core.sessions.open("t")
        core.sessions.subscribe_details("s")
        core.add_request(request("b", session="t", max_tokens=2))
        assert all(isinstance(i, SessionOutputs) for i in drain(other, "b", False))
        assert sum(isinstance(i, IterationDetails) for i in drain_all(asking)) == 2
    finally:
        core.shutdown()


def drain_all(q: queue.SimpleQueue[SessionItem]) -> list[SessionItem]:
    items = []
    while True:
        try:
            items.append(q.get(timeout=0.5))
        except queue.Empty:
            return items


def test_nothing_is_recorded_unless_asked() -> None:
    core = started()
    try:
        q = core.sessions.open("s")
        core.add_request(request("a", max_tokens=3))
        assert not any(isinstance(i, IterationDetails) for i in drain(q, "a", False))
        assert core.details.num_steps == 0 and not core._clocks
        assert "iteration_details" not in ok(call(core, q, "get_stats"))
    finally:
        core.shutdown()


def test_the_engine_flag_records_every_step_and_keeps_the_latest() -> None:
    core = started(EngineConfig(iteration_details=True))
    try:
        q = core.sessions.open("s")
        core.add_request(request("a", max_tokens=RECENT_STEPS + 4))
        items = drain(q, "a", False)
        assert not any(isinstance(i, IterationDetails) for i in items)  # none asked
        stats: dict[str, Any] = ok(call(core, q, "get_stats"))["iteration_details"]
        assert stats["steps"] == RECENT_STEPS + 4
        assert len(stats["recent"]) == RECENT_STEPS
        assert stats["totals"]["num_prefill_tokens"] == 3
        assert stats["totals"]["num_tokens"] == 3 + RECENT_STEPS + 3
    finally:
        core.shutdown()


def scheduled(rid: str, temperature: float) -> SchedulerOutput:
    prompt = [1, 2, 3, 4]
    return SchedulerOutput([ScheduledRequest(
        rid, prompt, 0, [0], True, SamplingParams(temperature=temperature, seed=1),
        prompt, [])], step=1)


def test_the_model_runner_times_its_forward_and_its_sampling() -> None:
    runner = tiny_runner_for_tests()
    sampled = runner.execute(scheduled("a", temperature=1.0))
    assert sampled.forward_s > 0 and sampled.sample_s > 0
    runner.execute(SchedulerOutput((), frozenset({"a"})))
    # A greedy step may take the one-call decode, whose argmax is part of the forward.
    greedy = runner.execute(scheduled("b", temperature=0.0))
    assert greedy.forward_s > 0 and greedy.sample_s >= 0


def test_a_recompute_after_preemption_counts_as_prefill() -> None:
    # Fed its prompt and its first outputs again in one chunk: prompt tokens, not decodes.
    recorder = IterationRecorder(True, lambda: False)
    prompt = [1, 2, 3]
    redo = ScheduledRequest("a", prompt + [4, 5], 0, [0, 1], True, SamplingParams(), prompt,
                            [4, 5])
    decode = ScheduledRequest("b", [9], 3, [2], True, SamplingParams(), prompt, [9])
    details = recorder.build(SchedulerOutput([redo, decode], step=7), RunnerOutput(),
                             StepClock(1.0, 0.001), 0.002, (3, 4))
    assert (details.num_prefill_requests, details.num_prefill_tokens,
            details.num_decode_requests, details.num_tokens) == (1, 5, 1, 6)
    assert (details.step, details.wave, details.wave_step) == (7, 3, 4)
