"""Sleep in EngineCore over the real runner on the tiny checkpoint: an asleep engine
schedules nothing (requests queue and run after wake), refuses to sleep over running
requests, and gets dropped weights back by a reload of its checkpoint (at its start
version) or by an update that replaces every tensor."""

from __future__ import annotations

import queue
import threading
from collections.abc import Iterator

import pytest

from services.engine.config import EngineConfig
from services.engine.core.engine_core import EngineCore
from services.engine.messages import SessionItem, UtilityCall, UtilityReply
from tests.unit.engine.fakes import (
    FakeRunner,
    call,
    collect,
    ok,
    request,
    tiny_runner_for_tests,
    tokens,
)

PROMPT = tuple(range(5, 45))  # more than one full block: cached


@pytest.fixture(scope="module")
def runner():  # type: ignore[no-untyped-def]
    return tiny_runner_for_tests()


@pytest.fixture
def core(runner) -> Iterator[EngineCore]:  # type: ignore[no-untyped-def]
    c = EngineCore(EngineConfig(weight_version="v0"), runner)
    yield c
    c.shutdown()


def _generate(core: EngineCore, q: queue.Queue[SessionItem], rid: str) -> tuple[list[int], str]:
    core.add_request(request(rid, prompt=PROMPT, max_tokens=6))
    updates, messages = collect(q, {rid})
    return tokens(updates[rid]), messages[-1].weight_version


@pytest.mark.timeout(60)
def test_asleep_requests_queue_and_run_after_wake(core: EngineCore) -> None:
    q = core.sessions.open("s")
    core.start()
    before = _generate(core, q, "a")
    asleep = ok(call(core, q, "sleep", {"level": 1}))
    assert asleep["is_sleeping"] and asleep["level"] == 1 and asleep["kv_cache_bytes"] > 0
    assert asleep["num_cached_blocks_dropped"] >= 1  # the prompt's blocks were cached
    core.add_request(request("b", prompt=PROMPT, max_tokens=6))
    stats = ok(call(core, q, "get_stats"))
    assert stats["sleep_level"] == 1 and stats["num_waiting"] == 1 and stats["num_running"] == 0
    assert stats["state"] == "RUNNING"
    assert q.empty()  # "b" has not started
    awake = ok(call(core, q, "wake_up", {"tags": ["kv_cache"]}))
    assert not awake["is_sleeping"] and awake["level"] == 0
    updates, messages = collect(q, {"b"})
    assert (tokens(updates["b"]), messages[-1].weight_version) == before


@pytest.mark.timeout(60)
def test_sleep_is_refused_over_running_requests() -> None:
    runner = FakeRunner()
    core = EngineCore(EngineConfig(), runner)
    try:
        q = core.sessions.open("s")
        runner.gate = threading.Event()
        core.start()
        core.add_request(request("r", prompt=(10,), max_tokens=4))
        while runner.steps < 1:  # the prefill step is running, held at the gate
            threading.Event().wait(0.005)
        core.call_utility(UtilityCall("s", 999, "pause", {"mode": "keep"}))
        runner.gate.set()
        while not isinstance(item := q.get(timeout=10), UtilityReply):
            pass
        assert item.call_id == 999 and not item.failure_message
        reply = call(core, q, "sleep", {"level": 1})
        assert ("1 requests are running and hold KV blocks; pause (mode abort or wait) "
                "until none run, then sleep") in reply.failure_message
        assert ok(call(core, q, "sleep_info"))["is_sleeping"] is False
        for args in ({"level": 3}, {"level": True}):
            assert "level must be 1" in call(core, q, "sleep", args).failure_message
        assert "tags must be a list of kv_cache, weights" in call(
            core, q, "wake_up", {"tags": ["kv"]}).failure_message
    finally:
        core.shutdown()


@pytest.mark.timeout(60)
def test_level_2_then_wake_reloads_the_checkpoint_at_the_start_version(
        core: EngineCore, runner) -> None:  # type: ignore[no-untyped-def]
    q = core.sessions.open("s")
    core.start()
    before = _generate(core, q, "a")
    path = runner.model_info.path
    # An update (of the same tensors) moves the version on; the reload moves it back.
    ok(call(core, q, "weights_start"))
    ok(call(core, q, "weights_stage", {"source": "disk", "path": path}))
    assert ok(call(core, q, "weights_commit", {"weight_version": "v7"}))["weight_version"] == "v7"
    asleep = ok(call(core, q, "sleep", {"level": 2}))
    assert asleep["level"] == 2 and asleep["weights_dropped"] and asleep["weights_bytes"] > 0
    awake = ok(call(core, q, "wake_up", {}))
    assert awake["reloaded_from"] == path and awake["weight_version"] == "v0"
    assert awake["level"] == 0
    assert _generate(core, q, "b") == before


@pytest.mark.timeout(60)
def test_an_update_while_asleep_brings_the_weights_back(core: EngineCore, runner) -> None:  # type: ignore[no-untyped-def]
    q = core.sessions.open("s")
    core.start()
    before_tokens, _ = _generate(core, q, "a")
    ok(call(core, q, "sleep", {"level": 2}))
    ok(call(core, q, "weights_start"))
    ok(call(core, q, "weights_stage", {"source": "disk", "path": runner.model_info.path}))
    ok(call(core, q, "weights_commit", {"weight_version": "v9"}))
    info = ok(call(core, q, "sleep_info"))
    assert info == {"is_sleeping": True, "level": 1, "kv_cache_freed": True,
                    "weights_dropped": False, "reloading_weights": False}
    awake = ok(call(core, q, "wake_up", {"tags": ["kv_cache", "weights"]}))
    assert "reloaded_from" not in awake and awake["level"] == 0
    assert _generate(core, q, "b") == (before_tokens, "v9")
