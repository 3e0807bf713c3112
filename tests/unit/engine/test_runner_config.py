from __future__ import annotations

import argparse

import pytest

from services.common.config import add_arguments, from_args, to_argv
from services.engine.worker.config import RunnerConfig


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("dtype", "float64"),
        ("device", "tpu"),
        ("block_size", 0),
        ("kv_cache_memory", 0),
        ("max_model_len", -1),
    ],
)
def test_invalid_values_name_the_field(field: str, value: object) -> None:
    with pytest.raises(ValueError, match=field):
        RunnerConfig(**{field: value})  # type: ignore[arg-type]


def test_round_trips_through_flags() -> None:
    config = RunnerConfig(model="/m", dtype="bfloat16", kv_cache_memory=1 << 20, block_size=32)
    parser = argparse.ArgumentParser()
    add_arguments(parser, RunnerConfig)
    argv = to_argv(config)
    assert "--kv-cache-memory" in argv
    assert from_args(RunnerConfig, parser.parse_args(argv)) == config
