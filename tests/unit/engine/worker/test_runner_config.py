from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from services.common.config import add_arguments, from_args, to_argv
from services.engine.worker.config import RunnerConfig
from services.engine.worker.kv_cache_memory import KVCacheMemory, available_host_memory


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("dtype", "float64"),
        ("device", "tpu"),
        ("block_size", 0),
        ("kv_cache_memory", 0),
        ("kv_cache_memory", "0"),
        ("kv_cache_memory", "1.5"),
        ("kv_cache_memory", "0.0"),
        ("kv_cache_memory", "256 furlongs"),
        ("kv_cache_memory", "-1GiB"),
        ("kv_cache_memory", ""),
        ("max_model_len", -1),
    ],
)
def test_invalid_values_name_the_field(field: str, value: object) -> None:
    with pytest.raises(ValueError, match=field):
        RunnerConfig(**{field: value})  # type: ignore[arg-type]


def test_round_trips_through_flags() -> None:
    config = RunnerConfig(model="/m", dtype="bfloat16", kv_cache_memory="0.25", block_size=32)
    parser = argparse.ArgumentParser()
    add_arguments(parser, RunnerConfig)
    argv = to_argv(config)
    assert "--kv-cache-memory" in argv
    assert from_args(RunnerConfig, parser.parse_args(argv)) == config


@pytest.mark.parametrize(
    ("text", "num_bytes"),
    [
        ("268435456", 268435456),
        ("256MiB", 256 << 20),
        ("2GiB", 2 << 30),
        ("2 gib", 2 << 30),
        ("1.5GB", 1_500_000_000),
        ("64KiB", 64 << 10),
        ("1", 1),
        (4 << 20, 4 << 20),
    ],
)
def test_kv_cache_memory_as_bytes(text: str | int, num_bytes: int) -> None:
    budget = RunnerConfig(kv_cache_memory=text).kv_cache_budget  # type: ignore[arg-type]
    assert budget == KVCacheMemory(num_bytes=num_bytes)
    assert budget.resolve(lambda: pytest.fail("bytes need no probe")) == num_bytes


def test_kv_cache_memory_as_a_fraction_of_free_memory() -> None:
    budget = RunnerConfig(kv_cache_memory="0.5").kv_cache_budget
    assert budget == KVCacheMemory(fraction=0.5)
    assert budget.resolve(lambda: 1000) == 500
    assert RunnerConfig(kv_cache_memory="1.0").kv_cache_budget.resolve(lambda: 7) == 7


def test_kv_cache_memory_auto_is_at_most_4gib_and_half_the_free_memory() -> None:
    budget = RunnerConfig().kv_cache_budget
    assert budget == RunnerConfig(kv_cache_memory=" AUTO ").kv_cache_budget == KVCacheMemory()
    assert budget.resolve(lambda: 24 << 30) == 4 << 30
    assert budget.resolve(lambda: 6 << 30) == 3 << 30


def test_host_memory_comes_from_meminfo(tmp_path: Path) -> None:
    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal:       16000 kB\nMemAvailable:    2048 kB\n")
    assert available_host_memory(meminfo) == 2048 * 1024
    assert available_host_memory() > 0


def test_host_memory_is_capped_by_the_cgroup_v2_limit(tmp_path: Path) -> None:
    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemAvailable:  16777216 kB\n")  # 16 GiB on the node
    cgroup = tmp_path / "cgroup"
    cgroup.mkdir()
    (cgroup / "memory.max").write_text(f"{4 << 30}\n")  # a 4 GiB pod limit
    (cgroup / "memory.current").write_text(f"{(1 << 30) + (256 << 20)}\n")
    # 256 MiB of the usage is page cache the kernel drops before it kills.
    (cgroup / "memory.stat").write_text(f"anon {1 << 30}\ninactive_file {256 << 20}\n")
    assert available_host_memory(meminfo, cgroup) == 3 << 30
    (cgroup / "memory.max").write_text("max\n")
    assert available_host_memory(meminfo, cgroup) == 16 << 30


def test_host_memory_is_capped_by_the_cgroup_v1_limit(tmp_path: Path) -> None:
    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemAvailable:  16777216 kB\n")
    memory = tmp_path / "cgroup" / "memory"
    memory.mkdir(parents=True)
    (memory / "memory.limit_in_bytes").write_text(f"{2 << 30}\n")
    (memory / "memory.usage_in_bytes").write_text(f"{3 << 30}\n")  # over: room 0, not < 0
    (memory / "memory.stat").write_text("total_inactive_file 0\n")
    assert available_host_memory(meminfo, tmp_path / "cgroup") == 0
    (memory / "memory.limit_in_bytes").write_text("9223372036854771712\n")  # no limit
    assert available_host_memory(meminfo, tmp_path / "cgroup") == 16 << 30
    # No cgroup files at all (not Linux cgroups): MemAvailable alone.
    assert available_host_memory(meminfo, tmp_path / "none") == 16 << 30


def test_host_memory_is_capped_by_the_limit_of_a_nested_cgroup(tmp_path: Path) -> None:
    # This sandbox's own layout: cgroup v1 on the host's tree, the process in
    # memory:/process_api/<id>; the limit may sit on it or on an ancestor.
    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemAvailable:  16777216 kB\n")
    membership = tmp_path / "proc-self-cgroup"
    membership.write_text("5:cpu:/\n4:memory:/process_api/84251\n0::/\n")
    root = tmp_path / "cgroup"
    levels = (root / "memory", root / "memory" / "process_api",
              root / "memory" / "process_api" / "84251")
    levels[-1].mkdir(parents=True)
    for level in levels:
        (level / "memory.limit_in_bytes").write_text("9223372036854771712\n")
        (level / "memory.usage_in_bytes").write_text(f"{1 << 30}\n")
        (level / "memory.stat").write_text("total_inactive_file 0\n")
    assert available_host_memory(meminfo, root, membership) == 16 << 30
    (levels[1] / "memory.limit_in_bytes").write_text(f"{8 << 30}\n")
    assert available_host_memory(meminfo, root, membership) == 7 << 30
    (levels[2] / "memory.limit_in_bytes").write_text(f"{3 << 30}\n")
    assert available_host_memory(meminfo, root, membership) == 2 << 30
