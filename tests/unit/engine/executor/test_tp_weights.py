"""The leader's and followers' sides of a tensor-parallel weight update, wired together
in one process: the leader's sends reach a follower per rank, whose reports come back."""

from __future__ import annotations

from typing import Any

import pytest

from services.engine.executor.tp_weights import FollowerWeights, LeaderWeights
from services.engine.weights.staging import MixedWeightsError, WeightUpdateError


class Runner:
    """A rank's runner: records each step; `fail` names the steps that raise."""

    def __init__(self, name: str, fail: tuple[str, ...] = ()) -> None:
        self.name = name
        self.fail = fail
        self.steps: list[str] = []

    def _do(self, step: str) -> Any:
        self.steps.append(step)
        if step in self.fail:
            raise WeightUpdateError(f"{step} failed on {self.name}")
        return ["w"] if step == "commit" else None

    def open_weight_update(self) -> None:
        self._do("open")

    def commit_weights(self) -> list[str]:
        return self._do("commit")

    def discard_weights(self) -> None:
        self._do("discard")

    def join_weight_transfer(self, spec: Any) -> None:
        self._do("join")

    def stage_weights(self, spec: Any) -> dict[str, Any]:
        return self._do("stage")


def wire(*followers: Runner, failure: str | None = None) -> LeaderWeights:
    leader: LeaderWeights

    def send(text: str) -> None:
        for rank, runner in enumerate(followers, start=1):
            FollowerWeights(runner, lambda message, r=rank: leader.on_report(r, message[1])
                            ).handle(text)

    leader = LeaderWeights(send, len(followers), lambda: failure)
    return leader


def test_every_rank_does_each_step() -> None:
    rank0, rank1, rank2 = Runner("0"), Runner("1"), Runner("2")
    leader = wire(rank1, rank2)
    leader.step("open", rank0.open_weight_update)
    assert leader.step("commit", rank0.commit_weights, all_or_none=True) == ["w"]
    assert rank0.steps == rank1.steps == rank2.steps == ["open", "commit"]


def test_a_worker_that_fails_a_step_fails_it_naming_the_rank() -> None:
    leader = wire(Runner("1"), Runner("2", fail=("open",)))
    with pytest.raises(WeightUpdateError, match="tensor-parallel rank 2: open failed on 2"):
        leader.step("open", Runner("0").open_weight_update)


def test_a_commit_that_only_some_ranks_made_is_a_mixed_model() -> None:
    leader = wire(Runner("1", fail=("commit",)))
    with pytest.raises(MixedWeightsError, match="succeeded on some tensor-parallel ranks"):
        leader.step("commit", Runner("0").commit_weights, all_or_none=True)
    # Failing everywhere is an ordinary failure: every rank still holds the old weights.
    leader = wire(Runner("1", fail=("commit",)))
    with pytest.raises(WeightUpdateError, match="commit failed on 0"):
        leader.step("commit", Runner("0", fail=("commit",)).commit_weights, all_or_none=True)


def test_a_dead_or_silent_worker_ends_the_wait() -> None:
    leader = LeaderWeights(lambda text: None, 1, lambda: "tensor-parallel worker 1 exited")
    with pytest.raises(WeightUpdateError, match="worker 1 exited"):
        leader.step("open", Runner("0").open_weight_update)
    leader = LeaderWeights(lambda text: None, 1, lambda: None)
    with pytest.raises(WeightUpdateError, match="1 tensor-parallel worker.* within 0.3 s"):
        leader.step("open", Runner("0").open_weight_update, timeout_s=0.3)
