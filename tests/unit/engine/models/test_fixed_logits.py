"""The fixed-logits stand-in model loads through the real loader and runner."""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np
import pytest

from tests.unit.engine.fixed_logits_checkpoint import VOCAB, write_checkpoint
from tests.unit.engine.runner_driver import generate, make_runner


def test_every_step_samples_the_fixed_argmax(tmp_path: Path) -> None:
    logits = np.zeros(VOCAB)
    logits[17] = 5.0
    runner = make_runner(write_checkpoint(tmp_path / "fixed", logits))
    out = generate(runner, {"a": [1, 2, 3], "b": [4, 5, 6, 7, 8, 9]}, num_tokens=5,
                   first_chunk={"b": 2})
    assert out == {"a": [17] * 5, "b": [17] * 5}


def test_a_paced_model_sleeps_each_step_without_spending_cpu(tmp_path: Path) -> None:
    logits = np.zeros(VOCAB)
    logits[9] = 1.0
    runner = make_runner(write_checkpoint(tmp_path / "paced", logits,
                                          corestream_step_seconds=0.05))
    wall, cpu = time.perf_counter(), time.thread_time()
    out = generate(runner, {"a": [1, 2, 3]}, num_tokens=4)
    wall, cpu = time.perf_counter() - wall, time.thread_time() - cpu
    assert out == {"a": [9] * 4}
    assert wall >= 4 * 0.05  # one forward per step: the prefill made the first token
    assert cpu < wall / 2


@pytest.mark.parametrize("seconds", [-0.001, 11.0])
def test_a_step_time_out_of_range_is_refused(tmp_path: Path, seconds: float) -> None:
    with pytest.raises(ValueError, match=r"corestream_step_seconds must be in \[0, 10\]"):
        make_runner(write_checkpoint(tmp_path / "bad", np.zeros(VOCAB),
                                     corestream_step_seconds=seconds))
