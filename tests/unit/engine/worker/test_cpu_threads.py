"""CPU threads of the model's operators: the cgroup quota, the flag, serve's shares, and
the OpenMP pool the loading thread leaves behind."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest
import torch

from services.cli.main import build_parser
from services.engine.worker.cgroup import cgroup_cpu_quota
from services.engine.worker.config import RunnerConfig
from services.engine.worker.cpu_threads import (
    release_openmp_pool,
    resolve_num_threads,
    usable_cpus,
)

AFFINITY = len(os.sched_getaffinity(0))


def cgroup_v2(root: Path, cpu_max: str) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    (root / "cpu.max").write_text(cpu_max + "\n")
    return root


def cgroup_v1(root: Path, quota_us: int, period_us: int = 100000) -> Path:
    (root / "cpu").mkdir(parents=True)
    (root / "cpu" / "cpu.cfs_quota_us").write_text(f"{quota_us}\n")
    (root / "cpu" / "cpu.cfs_period_us").write_text(f"{period_us}\n")
    return root


def test_quota_is_read_from_cgroup_v2_and_v1(tmp_path: Path) -> None:
    assert cgroup_cpu_quota(cgroup_v2(tmp_path / "a", "max 100000")) is None
    assert cgroup_cpu_quota(cgroup_v2(tmp_path / "b", "250000 100000")) == 2.5
    assert cgroup_cpu_quota(cgroup_v1(tmp_path / "c", -1)) is None
    assert cgroup_cpu_quota(cgroup_v1(tmp_path / "d", 50000, 100000)) == 0.5
    assert cgroup_cpu_quota(tmp_path / "none") is None


def test_usable_cpus_are_the_affinity_capped_by_the_quota(tmp_path: Path) -> None:
    assert usable_cpus(tmp_path / "none") == AFFINITY
    # A limit of half a CPU still runs one thread; a fractional limit rounds down.
    assert usable_cpus(cgroup_v1(tmp_path / "half", 50000)) == 1
    assert usable_cpus(cgroup_v2(tmp_path / "many", "6400000 100000")) == AFFINITY
    if AFFINITY >= 2:
        assert usable_cpus(cgroup_v2(tmp_path / "one-and-a-half", "150000 100000")) == 1


def test_flag_is_validated_and_resolved(monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(ValueError, match="num_threads must be >= 0"):
        RunnerConfig(num_threads=-1)
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    assert resolve_num_threads(3) == 3
    assert resolve_num_threads(0) == usable_cpus()
    # The operator's OMP_NUM_THREADS stands unless the flag says otherwise.
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    assert resolve_num_threads(0) is None
    assert resolve_num_threads(2) == 2


def test_runner_sets_the_intra_op_pool(tmp_path: Path) -> None:
    from services.engine.worker.model_runner import ModelRunner

    before = torch.get_num_threads()
    try:
        ModelRunner(RunnerConfig(model="", num_threads=1, kv_cache_memory="1MiB",
                                 max_model_len=64, device="cpu"))
        assert torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(before)


def engine_threads(argv: list[str]) -> list[str | None]:
    from services.serve.launcher import plan

    args = build_parser().parse_args(["serve", *argv])
    _, children, _, _ = plan(args, "unused-model-path")
    found = []
    for child in children:
        if child.name.startswith("engine-"):
            flags = child.argv
            found.append(flags[flags.index("--num-threads") + 1]
                         if "--num-threads" in flags else None)
    return found


def test_serve_gives_each_engine_its_share_of_the_cpus(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("services.serve.launcher.usable_cpus", lambda: 8)
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    assert engine_threads([]) == [None]  # one engine: all of them, its own default
    assert engine_threads(["--engines", "2"]) == ["4", "4"]
    assert engine_threads(["--engines", "3"]) == ["2", "2", "2"]
    assert engine_threads(["--engines", "16"]) == ["1"] * 16
    # An explicit count, or engines on GPUs, are left alone.
    assert engine_threads(["--engines", "2", "--num-threads", "3"]) == ["3", "3"]
    assert engine_threads(["--engines", "2", "--device", "cuda"]) == [None, None]
    monkeypatch.setenv("OMP_NUM_THREADS", "3")  # the operator's choice, inherited
    assert engine_threads(["--engines", "2"]) == [None, None]


def _tids() -> set[str]:
    return set(os.listdir("/proc/self/task"))


def test_release_openmp_pool_ends_this_threads_workers() -> None:
    previous = torch.get_num_threads()
    torch.set_num_threads(3)
    try:
        release_openmp_pool()  # whatever pool earlier tests left on this thread
        big = torch.randn(1024, 1024)
        # Thread ids, not counts: threads of earlier tests (gRPC pools, executors) may
        # end at any moment and must not count as the pool's.
        before = _tids()
        _ = big @ big  # a parallel region: this thread now keeps 2 OpenMP workers
        workers = _tids() - before
        assert len(workers) == 2
        assert release_openmp_pool()
        # The workers exit on their own schedule after the call returns.
        deadline = time.monotonic() + 5
        while workers & _tids() and time.monotonic() < deadline:
            time.sleep(0.01)
        assert not workers & _tids()
        released = _tids()
        _ = big @ big  # and the next parallel region starts a new pool
        assert len(_tids() - released) == 2
    finally:
        torch.set_num_threads(previous)


def _torch_openmp_runtime() -> Path:
    torch_dir = Path(torch.__file__).parent
    for line in Path("/proc/self/maps").read_text().splitlines():
        fields = line.split(maxsplit=5)
        if (len(fields) == 6 and Path(fields[5]).name.startswith("libgomp")
                and Path(fields[5]).is_relative_to(torch_dir)):
            return Path(fields[5])
    raise AssertionError("torch's wheel links GNU OpenMP; its libgomp is not mapped")


def test_release_reaches_torchs_runtime_past_another_one(tmp_path: Path) -> None:
    # scikit-learn (pulled in by sentence-transformers) bundles its own libgomp, which
    # sorts before torch's; pausing it succeeds and frees nothing of torch's.
    torch_runtime = _torch_openmp_runtime()
    other = tmp_path / "aaa" / "libgomp-other.so.1"
    other.parent.mkdir()
    other.write_bytes(torch_runtime.read_bytes())  # a separate copy: its own pools
    maps = tmp_path / "maps"
    maps.write_text(f"7f00-7f10 r-xp 0 08:01 1 {other}\n"
                    f"7f10-7f20 r-xp 0 08:01 2 {torch_runtime}\n")
    previous = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        release_openmp_pool()
        big = torch.randn(1024, 1024)
        before = _tids()
        _ = big @ big
        workers = _tids() - before
        assert len(workers) == 1
        assert release_openmp_pool(maps)
        deadline = time.monotonic() + 5
        while workers & _tids() and time.monotonic() < deadline:
            time.sleep(0.01)
        assert not workers & _tids()
    finally:
        torch.set_num_threads(previous)


def test_release_openmp_pool_without_a_runtime_does_nothing(tmp_path: Path) -> None:
    maps = tmp_path / "maps"
    maps.write_text("7f00-7f10 r-xp 00000000 08:01 1 /usr/lib/libc.so.6\n7f10-7f20 rw-p 0 0 0\n")
    assert not release_openmp_pool(maps)
    assert not release_openmp_pool(tmp_path / "missing")


def engine_flag(argv: list[str], flag: str) -> list[str | None]:
    from services.serve.launcher import plan

    args = build_parser().parse_args(["serve", *argv])
    _, children, _, _ = plan(args, "unused-model-path")
    return [c.argv[c.argv.index(flag) + 1] if flag in c.argv else None
            for c in children if c.name.startswith("engine-")]


def test_serve_gives_each_engine_cpus_or_devices_of_its_own(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1, 2, 3, 4, 5, 6, 7, 9})
    assert engine_flag([], "--cpu-set") == [None]  # one engine: every CPU
    assert engine_flag(["--engines", "2"], "--cpu-set") == ["0-3", "4-7"]
    assert engine_flag(["--engines", "2", "--tensor-parallel-size", "2"],
                       "--cpu-set") == ["0-3", "4-7"]  # the ranks split each set again
    assert engine_flag(["--engines", "3"], "--cpu-set") == ["0-2", "3-5", "6-7,9"]
    assert engine_flag(["--engines", "2", "--cpu-set", "0-1"], "--cpu-set") == ["0-1", "0-1"]
    assert engine_flag(["--engines", "16"], "--cpu-set") == [None] * 16  # too few CPUs
    # On GPUs each engine's ranks take the devices after the previous engine's.
    assert engine_flag(["--engines", "2", "--device", "cuda", "--tensor-parallel-size", "2"],
                       "--device") == ["cuda:0", "cuda:2"]
    assert engine_flag(["--engines", "2", "--device", "cuda:1"], "--device") == [
        "cuda:1", "cuda:2"]


def test_quota_of_a_nested_cgroup_and_its_ancestors(tmp_path: Path) -> None:
    # On a host (a systemd service, a container in the host's cgroup namespace) the
    # process's cgroup is a path under the mount, and its pod's limit sits above it.
    membership = tmp_path / "proc-self-cgroup"
    membership.write_text("0::/kubepods/pod1/ctr\n")
    v2 = tmp_path / "v2"
    (v2 / "kubepods" / "pod1" / "ctr").mkdir(parents=True)
    (v2 / "cgroup.controllers").write_text("cpu memory\n")
    cgroup_v2(v2 / "kubepods" / "pod1", "300000 100000")
    cgroup_v2(v2 / "kubepods" / "pod1" / "ctr", "max 100000")
    assert cgroup_cpu_quota(v2, membership) == 3.0
    cgroup_v2(v2 / "kubepods" / "pod1" / "ctr", "150000 100000")  # the tighter one wins
    assert cgroup_cpu_quota(v2, membership) == 1.5
    # cgroup v1: the cpu controller's line names the path (here in a joint hierarchy).
    membership.write_text("4:memory:/other\n3:cpu,cpuacct:/system.slice/corestream\n")
    cgroup_v1(tmp_path / "v1", -1)
    (tmp_path / "v1" / "cpu" / "system.slice" / "corestream").mkdir(parents=True)
    for name, value in (("cpu.cfs_quota_us", 200000), ("cpu.cfs_period_us", 100000)):
        (tmp_path / "v1" / "cpu" / "system.slice" / "corestream" / name).write_text(
            f"{value}\n")
    assert cgroup_cpu_quota(tmp_path / "v1", membership) == 2.0
    # A path the mount does not hold (the process's own subtree mounted as the root, as
    # Docker does without a cgroup namespace) falls back to the mount's root.
    membership.write_text("0::/docker/abc\n")
    assert cgroup_cpu_quota(cgroup_v2(tmp_path / "own", "50000 100000"), membership) == 0.5
