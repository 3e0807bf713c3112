"""The test-only fault injection's parsing and its SIGUSR2-armed fault."""

from __future__ import annotations

import os
import signal
import time
from typing import Any

import pytest

from services.engine.executor.fault_injection import (
    FaultInjectingRunner,
    FaultSpec,
    InjectedFault,
    maybe_inject,
)


class Runner:
    def __init__(self) -> None:
        self.calls = 0

    def execute(self, out: Any) -> int:
        self.calls += 1
        return self.calls


def test_kinds_parse_with_and_without_a_count() -> None:
    assert FaultSpec.parse("raise_once_after_steps:3@1") == FaultSpec(
        "raise_once_after_steps", 3, 1)
    assert FaultSpec.parse("raise_on_sigusr2") == FaultSpec("raise_on_sigusr2", 0)
    assert FaultSpec.parse("raise_on_sigusr2@0") == FaultSpec("raise_on_sigusr2", 0, 0)
    with pytest.raises(ValueError, match="KIND:N"):
        FaultSpec.parse("raise_after_steps")
    with pytest.raises(ValueError, match="KIND:N"):
        FaultSpec.parse("explode:1")


def test_each_sigusr2_makes_the_next_execute_raise_once() -> None:
    previous = signal.getsignal(signal.SIGUSR2)
    try:
        runner = maybe_inject(Runner(), "raise_on_sigusr2", engine_index=0)
        assert isinstance(runner, FaultInjectingRunner)
        assert runner.execute(None) == 1
        for _ in range(2):
            os.kill(os.getpid(), signal.SIGUSR2)
            # The handler runs on this (the main) thread at the next bytecode boundary.
            deadline = time.monotonic() + 5
            while not runner._signalled.is_set() and time.monotonic() < deadline:
                time.sleep(0.01)
            with pytest.raises(InjectedFault, match="SIGUSR2"):
                runner.execute(None)
            assert runner.execute(None) == runner._runner.calls  # once, then steps again
    finally:
        signal.signal(signal.SIGUSR2, previous)


def test_a_fault_for_another_engine_leaves_the_runner_alone() -> None:
    runner = Runner()
    assert maybe_inject(runner, "raise_on_sigusr2@1", engine_index=0) is runner
