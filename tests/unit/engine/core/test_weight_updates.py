"""Live weight updates in EngineCore, against a fake runner whose "weights" are an
offset added to every sampled token: the commit happens between two steps, every
output carries the version of the weights that made it, a request frozen by a keep
pause across an update continues on the new weights, and a failed update changes
nothing."""

from __future__ import annotations

import queue
import threading
from collections.abc import Iterator
from typing import Any

import pytest

from services.engine.config import EngineConfig
from services.engine.core.engine_core import EngineCore
from services.engine.messages import SessionItem, SessionOutputs, UtilityCall, UtilityReply
from services.engine.scheduler.output import RunnerOutput, SchedulerOutput
from services.engine.weights.sources import SourceSpec
from services.engine.weights.staging import WeightUpdateError
from tests.unit.engine.fakes import VOCAB, FakeRunner, call, collect, ok, request


class WeightedRunner(FakeRunner):
    """Samples (last token + 1 + offset) % VOCAB; an update from "disk" path "N" sets
    the offset to N, and path "bad" fails as a bad tensor would."""

    def __init__(self) -> None:
        super().__init__()
        self.offset = 0
        self.tensor_parallel_size = 1
        self._staged: int | None = None
        self.opened = False

    def execute(self, out: SchedulerOutput) -> RunnerOutput:
        result = super().execute(out)
        return RunnerOutput({rid: (t + self.offset) % VOCAB for rid, t in result.sampled.items()})

    def open_weight_update(self) -> None:
        self.opened = True
        self._staged = None

    def stage_weights(self, spec: SourceSpec) -> dict[str, Any]:
        if spec.path == "bad":
            raise WeightUpdateError("tensor 'x': the model has no such tensor")
        self._staged = int(spec.path)
        return {"num_tensors": 1, "num_bytes": 4}

    def commit_weights(self) -> list[str]:
        assert self._staged is not None
        self.offset, self._staged = self._staged, None
        return ["offset"]

    def discard_weights(self) -> None:
        self.opened = False
        self._staged = None


@pytest.fixture
def runner() -> WeightedRunner:
    return WeightedRunner()


@pytest.fixture
def core(runner: WeightedRunner) -> Iterator[EngineCore]:
    c = EngineCore(EngineConfig(weight_version="v0"), runner)
    yield c
    c.shutdown()


def _update(core: EngineCore, q: queue.Queue[SessionItem], offset: str,
            version: str | None = None, seen: list[SessionOutputs] | None = None
            ) -> dict[str, Any]:
    ok(call(core, q, "weights_start", seen=seen))
    ok(call(core, q, "weights_stage", {"source": "disk", "path": offset}, seen=seen))
    args = {} if version is None else {"weight_version": version}
    return ok(call(core, q, "weights_commit", args, seen=seen))


def _versions(messages: list[SessionOutputs], rid: str) -> list[tuple[int, str]]:
    return [(t, m.weight_version) for m in messages for u in m.updates
            if u.request_id == rid for t in u.new_token_ids]


@pytest.mark.timeout(30)
def test_outputs_carry_the_version_of_their_weights(core: EngineCore,
                                                    runner: WeightedRunner) -> None:
    q = core.sessions.open("s")
    core.start()
    core.add_request(request("a", prompt=(10,), max_tokens=2))
    _, before = collect(q, {"a"})
    assert _versions(before, "a") == [(11, "v0"), (12, "v0")]
    result = _update(core, q, "5", "v1")
    assert result["weight_version"] == "v1" and result["previous_weight_version"] == "v0"
    core.add_request(request("b", prompt=(10,), max_tokens=2))
    _, after = collect(q, {"b"})
    assert _versions(after, "b") == [(16, "v1"), (22, "v1")]
    # Unnamed: a version that is not a number gets "+1".
    assert _update(core, q, "0")["weight_version"] == "v1+1"
    assert ok(call(core, q, "weights_info"))["weight_version"] == "v1+1"


@pytest.mark.timeout(30)
def test_a_request_kept_across_an_update_continues_on_the_new_weights(
        core: EngineCore, runner: WeightedRunner) -> None:
    q = core.sessions.open("s")
    runner.gate = threading.Event()
    core.start()
    core.add_request(request("r", prompt=(10,), max_tokens=4))
    while runner.steps < 1:  # the prefill step is running, held at the gate
        threading.Event().wait(0.005)
    # Taken between the prefill step and the next: the request is frozen after 1 token.
    core.call_utility(UtilityCall("s", 999, "pause", {"mode": "keep"}))
    runner.gate.set()
    seen: list[SessionOutputs] = []
    while not isinstance(item := q.get(timeout=10), UtilityReply):
        assert isinstance(item, SessionOutputs)
        seen.append(item)
    assert item.call_id == 999 and not item.failure_message
    result = _update(core, q, "50", "v1", seen=seen)
    assert result["num_running"] == 1
    ok(call(core, q, "resume", seen=seen))
    updates, rest = collect(q, {"r"})
    assert _versions(seen + rest, "r") == [(11, "v0"), (62, "v1"), (13, "v1"), (64, "v1")]
    assert runner.steps == 4


@pytest.mark.timeout(30)
def test_the_update_drops_the_prefix_cache(core: EngineCore) -> None:
    q = core.sessions.open("s")
    core.start()
    core.add_request(request("a", prompt=tuple(range(1, 10)), max_tokens=2))
    collect(q, {"a"})
    assert ok(call(core, q, "get_stats"))["num_cached_blocks"] >= 2
    assert _update(core, q, "1")["num_cached_blocks_dropped"] >= 2
    assert ok(call(core, q, "get_stats"))["num_cached_blocks"] == 0


@pytest.mark.timeout(30)
def test_a_failed_update_changes_nothing(core: EngineCore, runner: WeightedRunner) -> None:
    q = core.sessions.open("s")
    core.start()
    ok(call(core, q, "weights_start"))
    reply = call(core, q, "weights_stage", {"source": "disk", "path": "bad"})
    assert "tensor 'x': the model has no such tensor" in reply.failure_message
    info = ok(call(core, q, "weights_info"))
    assert info["weight_version"] == "v0" and info["update"] == "none"
    assert not runner.opened  # the staged part was dropped
    reply = call(core, q, "weights_commit", {"weight_version": "v1"})
    assert "no weight update is open" in reply.failure_message
    core.add_request(request("a", prompt=(10,), max_tokens=1))
    updates, messages = collect(q, {"a"})
    assert _versions(messages, "a") == [(11, "v0")]


@pytest.mark.timeout(30)
def test_bad_calls_are_refused_with_the_reason(core: EngineCore) -> None:
    q = core.sessions.open("s")
    core.start()
    assert "no weight update is open" in call(
        core, q, "weights_stage", {"source": "disk", "path": "1"}).failure_message
    ok(call(core, q, "weights_start"))
    assert "a weight update is under way" in call(core, q, "weights_start").failure_message
    assert "source must be one of disk, broadcast, shared_memory" in call(
        core, q, "weights_stage", {"source": "ftp"}).failure_message
    assert "names, dtype_names and shapes must be as long as each other" in call(
        core, q, "weights_stage", {"source": "broadcast", "names": ["a"],
                                   "dtype_names": [], "shapes": []}).failure_message
    assert "weight_version must be 1-128 printable characters" in call(
        core, q, "weights_commit", {"weight_version": "x" * 129}).failure_message
    assert "rank_offset must be >= 1" in call(core, q, "weights_init_transfer", {
        "master_address": "127.0.0.1", "master_port": 1234, "rank_offset": 0,
        "world_size": 2}).failure_message
    assert ok(call(core, q, "weights_abort"))["aborted"] is True


