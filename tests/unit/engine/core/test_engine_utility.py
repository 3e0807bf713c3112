"""Utility calls on EngineCore (run on the loop thread, answered to the calling
Session): stats, prefix-cache reset, pause modes and resume, failures."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from services.engine.config import EngineConfig
from services.engine.core.engine_core import EngineCore
from services.engine.messages import SessionOutputs, UtilityCall, UtilityReply
from services.engine.request import FinishReason, RequestUpdate
from tests.unit.engine.fakes import FakeRunner, call, collect, ok, request, tokens


def wait_until(predicate: Any, timeout: float = 10) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.01)


@pytest.fixture
def runner() -> FakeRunner:
    return FakeRunner()


@pytest.fixture
def core(runner: FakeRunner) -> Iterator[EngineCore]:
    c = EngineCore(EngineConfig(), runner)
    yield c
    c.shutdown()


@pytest.mark.timeout(30)
def test_get_stats_reports_scheduler_and_cache(core: EngineCore, runner: FakeRunner) -> None:
    q = core.sessions.open("s")
    core.start()
    core.add_request(request("r", prompt=tuple(range(1, 10)), max_tokens=3))
    collect(q, {"r"})
    stats = ok(call(core, q, "get_stats"))
    assert stats["state"] == "RUNNING" and stats["paused"] is None
    assert stats["num_running"] == 0 and stats["num_waiting"] == 0
    assert stats["num_free_blocks"] == stats["num_blocks"] == runner.num_blocks
    assert stats["kv_cache_usage"] == 0
    assert stats["num_cached_blocks"] >= 2  # the prompt's two full blocks
    assert stats["prefix_cache_queries"] == 9 and stats["step_counter"] >= 3


@pytest.mark.timeout(30)
def test_unknown_or_malformed_utility_fails_and_engine_keeps_serving(core: EngineCore) -> None:
    q = core.sessions.open("s")
    core.start()
    reply = call(core, q, "profile_start")
    assert "unknown utility method 'profile_start'" in reply.failure_message
    assert not reply.result_json
    reply = call(core, q, "pause", {"mode": "sideways"})
    assert "unknown pause mode 'sideways'" in reply.failure_message
    assert ok(call(core, q, "get_stats"))["paused"] is None
    core.add_request(request("after"))
    by_id, _ = collect(q, {"after"})
    assert by_id["after"][-1].finish_reason is FinishReason.LENGTH


@pytest.mark.timeout(30)
def test_reset_prefix_cache_refused_while_running_then_drops_cache(
        core: EngineCore, runner: FakeRunner) -> None:
    q = core.sessions.open("s")
    runner.delay_s = 0.02
    core.start()
    prompt = tuple(range(1, 10))
    core.add_request(request("r", prompt=prompt, max_tokens=30))
    seen: list[SessionOutputs] = []
    wait_until(lambda: core.stats.num_running == 1)
    reply = call(core, q, "reset_prefix_cache", seen=seen)
    assert "requests are running" in reply.failure_message
    assert "reset_prefix_cache" in reply.failure_message
    # The failed call changed nothing: the request runs on to its end.
    by_id, _ = collect(q, {"r"})
    updates = [u for m in seen for u in m.updates] + by_id["r"]
    assert len(tokens(updates)) == 30

    assert ok(call(core, q, "reset_prefix_cache"))["num_blocks_dropped"] >= 2
    assert ok(call(core, q, "get_stats"))["num_cached_blocks"] == 0
    core.scheduler.kv_cache.check_integrity()
    # The same prompt again finds nothing cached.
    core.add_request(request("again", prompt=prompt, max_tokens=1))
    by_id, _ = collect(q, {"again"})
    assert by_id["again"][-1].num_cached_tokens == 0


@pytest.mark.timeout(30)
def test_pause_wait_answers_once_running_finished_and_queues_new(core: EngineCore,
                                                                runner: FakeRunner) -> None:
    q = core.sessions.open("s")
    runner.delay_s = 0.01
    core.start()
    core.add_request(request("running", max_tokens=20))
    wait_until(lambda: core.stats.num_running == 1)
    core.add_request(request("queued", max_tokens=2))
    seen: list[SessionOutputs] = []
    paused = ok(call(core, q, "pause", {"mode": "wait"}, seen=seen))
    # The reply comes after the step that finished the running request, not before.
    assert paused == {"mode": "wait", "num_aborted": 0, "num_running": 0, "num_waiting": 1,
                      "num_cached_blocks_dropped": 0}
    finished = [u for m in seen for u in m.updates if u.finished]
    assert [(u.request_id, u.finish_reason) for u in finished] == [
        ("running", FinishReason.LENGTH)]
    assert len(tokens([u for m in seen for u in m.updates])) == 20
    time.sleep(0.2)  # a paused engine must not admit "queued" meanwhile
    stats = ok(call(core, q, "get_stats"))
    assert stats["paused"] == "wait" and stats["num_running"] == 0
    assert stats["num_waiting"] == 1 and stats["state"] == "RUNNING"
    # With nothing running, a second wait pause answers at once.
    assert ok(call(core, q, "pause", {"mode": "wait"}))["num_running"] == 0
    assert ok(call(core, q, "resume"))["was_paused"] == "wait"
    by_id, _ = collect(q, {"queued"})
    assert tokens(by_id["queued"]) == [4, 5]


@pytest.mark.timeout(30)
def test_pause_wait_still_answers_when_resumed_or_switched_to_abort(
        core: EngineCore, runner: FakeRunner) -> None:
    q = core.sessions.open("s")
    other = core.sessions.open("other")
    runner.delay_s = 0.02
    core.start()
    core.add_request(request("long", max_tokens=200))
    wait_until(lambda: core.stats.num_running == 1)
    core.call_utility(UtilityCall("other", 1, "pause", {"mode": "wait"}))
    # The running request outlives this: a resume (another caller) answers the wait.
    ok(call(core, q, "resume"))
    reply = _reply(other)
    assert ok(reply)["num_running"] == 1
    core.call_utility(UtilityCall("other", 2, "pause", {"mode": "wait"}))
    aborted = ok(call(core, q, "pause", {"mode": "abort"}))
    assert aborted["num_aborted"] == 1
    assert ok(_reply(other))["num_running"] == 0
    ok(call(core, q, "resume"))


def _reply(q: Any) -> Any:
    while True:
        item = q.get(timeout=10)
        if isinstance(item, UtilityReply):
            return item


@pytest.mark.timeout(30)
def test_pause_keep_freezes_requests_until_resume(core: EngineCore,
                                                  runner: FakeRunner) -> None:
    q = core.sessions.open("s")
    runner.delay_s = 0.01
    core.start()
    core.add_request(request("frozen", max_tokens=30))
    wait_until(lambda: core.stats.num_running == 1)
    seen: list[SessionOutputs] = []
    ok(call(core, q, "pause", {"mode": "keep"}, seen=seen))
    steps = runner.steps
    time.sleep(0.2)
    assert runner.steps == steps and q.empty()
    stats = ok(call(core, q, "get_stats"))
    assert stats["paused"] == "keep" and stats["num_running"] == 1
    assert stats["kv_cache_usage"] > 0
    ok(call(core, q, "resume"))
    by_id, _ = collect(q, {"frozen"})
    all_updates: list[RequestUpdate] = [u for m in seen for u in m.updates] + by_id["frozen"]
    assert len(tokens(all_updates)) == 30


@pytest.mark.timeout(30)
def test_pause_abort_ends_requests_and_queues_new(core: EngineCore,
                                                  runner: FakeRunner) -> None:
    q = core.sessions.open("s")
    runner.delay_s = 0.01
    core.start()
    core.add_request(request("doomed", max_tokens=50))
    wait_until(lambda: core.stats.num_running == 1)
    seen: list[SessionOutputs] = []
    result = ok(call(core, q, "pause", {"mode": "abort"}, seen=seen))
    assert result["num_aborted"] == 1
    ends = [u for m in seen for u in m.updates if u.finished]
    assert [(u.request_id, u.finish_reason) for u in ends] == [("doomed", FinishReason.PAUSED)]
    core.add_request(request("later", max_tokens=2))
    time.sleep(0.1)
    stats = ok(call(core, q, "get_stats"))
    assert stats["num_waiting"] == 1 and stats["num_free_blocks"] == runner.num_blocks
    ok(call(core, q, "resume"))
    by_id, _ = collect(q, {"later"})
    assert by_id["later"][-1].finish_reason is FinishReason.LENGTH


@pytest.mark.timeout(30)
def test_utility_on_stopped_engine_fails_at_once(core: EngineCore) -> None:
    q = core.sessions.open("s")
    core.start()
    core.shutdown()
    reply = call(core, q, "get_stats")
    assert "get_stats" in reply.failure_message and "stopped" in reply.failure_message


@pytest.mark.timeout(60)
def test_profile_start_stop_writes_a_trace_of_the_steps_between(tmp_path: Any) -> None:
    from tests.unit.engine.fakes import real_request, tiny_runner_for_tests

    core = EngineCore(EngineConfig(profile_dir=str(tmp_path)), tiny_runner_for_tests())
    q = core.sessions.open("s")
    core.start()
    try:
        assert "no profile is running" in call(core, q, "profile", {"action": "stop"}
                                                 ).failure_message
        assert ok(call(core, q, "profile", {"action": "start"}))["profiling"] is True
        assert "already running" in call(core, q, "profile", {"action": "start"}
                                         ).failure_message
        core.add_request(real_request("profiled", (1, 2, 3, 4, 5), 4))
        collect(q, {"profiled"})
        result = ok(call(core, q, "profile", {"action": "stop"}))
        trace = json.loads(Path(result["trace"]).read_text())
        names = {e.get("name", "") for e in trace["traceEvents"]}
        assert any(n.startswith("aten::") for n in names)  # the forward passes were traced
        assert result["top_operators"] and result["top_operators"][0]["calls"] > 0
        assert str(tmp_path) in result["trace"]
        assert "profile action" in call(core, q, "profile", {"action": "pause"}).failure_message
    finally:
        core.shutdown()


@pytest.mark.timeout(30)
def test_profile_on_a_runner_without_a_profiler_fails_cleanly(core: EngineCore) -> None:
    q = core.sessions.open("s")
    core.start()
    reply = call(core, q, "profile", {"action": "start"})
    assert "cannot profile" in reply.failure_message
    assert ok(call(core, q, "get_stats"))["state"] == "RUNNING"
