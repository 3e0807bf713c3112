"""The limits a Linux control group (a container's CPU and memory limits) puts on this
process, read from the cgroup filesystem, v2 (unified) or v1.

Torch-free, like the rest of the engine's sizing: the runner asks how many threads
(`cpu_threads`) and how much KV-cache memory (`kv_cache_memory`) it may use.
"""

from __future__ import annotations

from pathlib import Path

CGROUP_ROOT = Path("/sys/fs/cgroup")


def cgroup_cpu_quota(cgroup_root: Path = CGROUP_ROOT) -> float | None:
    """The CPU quota in CPUs (a Kubernetes CPU limit), or None when there is none."""
    v2 = cgroup_root / "cpu.max"  # "max 100000" or "<quota> <period>"
    if v2.is_file():
        quota, _, period = v2.read_text().strip().partition(" ")
        return None if quota == "max" else int(quota) / int(period or 100000)
    v1 = cgroup_root / "cpu"
    try:
        quota_us = int((v1 / "cpu.cfs_quota_us").read_text())
        period_us = int((v1 / "cpu.cfs_period_us").read_text())
    except (OSError, ValueError):
        return None
    return None if quota_us <= 0 or period_us <= 0 else quota_us / period_us


def cgroup_memory_room(cgroup_root: Path = CGROUP_ROOT) -> int | None:
    """Bytes left under the memory cgroup's limit (v2 `memory.max`, v1
    `memory.limit_in_bytes`), or None when there is no limit.

    Usage counts like the kernel's working set, which the limit is enforced on after
    reclaim: the page cache the kernel could drop first (inactive file pages) is free.
    """
    v2 = cgroup_root / "memory.max"
    if v2.is_file():
        files = (v2, cgroup_root / "memory.current", cgroup_root / "memory.stat")
        inactive_key = "inactive_file"
    else:
        v1 = cgroup_root / "memory"
        files = (v1 / "memory.limit_in_bytes", v1 / "memory.usage_in_bytes",
                 v1 / "memory.stat")
        inactive_key = "total_inactive_file"
    try:
        limit_text, usage_text, stat = (f.read_text() for f in files)
    except OSError:
        return None
    limit_text = limit_text.strip()
    # v1 writes "no limit" as a page-rounded 2^63 - 1.
    if limit_text == "max" or int(limit_text) >= 1 << 62:
        return None
    inactive = next((int(line.split()[1]) for line in stat.splitlines()
                     if line.split(" ", 1)[0] == inactive_key), 0)
    working_set = max(0, int(usage_text) - inactive)
    return max(0, int(limit_text) - working_set)
