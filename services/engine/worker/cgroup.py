"""The limits a Linux control group (a container's CPU and memory limits) puts on this
process, read from the cgroup filesystem, v2 (unified) or v1.

Torch-free, like the rest of the engine's sizing: the runner asks how many threads
(`cpu_threads`) and how much KV-cache memory (`kv_cache_memory`) it may use.
"""

from __future__ import annotations

from pathlib import Path

CGROUP_ROOT = Path("/sys/fs/cgroup")
MEMBERSHIP = Path("/proc/self/cgroup")


def _own_levels(cgroup_root: Path, membership: Path, v2_file: str,
                controller: str) -> tuple[list[Path], bool]:
    """(this process's cgroup directory and each ancestor up to the hierarchy's mount,
    innermost first; whether the hierarchy is v2).

    A container with its own cgroup namespace sees its cgroup as the mount's root; but on
    a host (a systemd service, a container sharing the host's namespace, this sandbox's
    memory cgroup) the process sits deeper, and a limit set on it or on an ancestor (a
    Kubernetes pod's, above its containers') binds as well: the tightest one wins.
    """
    v2 = (cgroup_root / "cgroup.controllers").is_file() or (cgroup_root / v2_file).is_file()
    mount = cgroup_root if v2 else cgroup_root / controller
    path = "/"
    try:
        lines = membership.read_text().splitlines()
    except OSError:
        lines = []
    for line in lines:
        # "hierarchy-id:controllers:path"; v2's single hierarchy has id 0, no controllers.
        hierarchy, _, rest = line.partition(":")
        controllers, _, own = rest.partition(":")
        if (v2 and hierarchy == "0" and not controllers) or (
                not v2 and controller in controllers.split(",")):
            path = own
            break
    own_dir = mount / path.lstrip("/")
    if not own_dir.is_dir():
        # A mount of the process's own subtree: the path names the host's hierarchy.
        own_dir = mount
    return [own_dir, *(d for d in own_dir.parents if d.is_relative_to(mount))], v2


def cgroup_cpu_quota(cgroup_root: Path = CGROUP_ROOT,
                     membership: Path = MEMBERSHIP) -> float | None:
    """The CPU quota in CPUs (a Kubernetes CPU limit), or None when there is none: the
    smallest over this process's cgroup and its ancestors (`_own_levels`)."""
    levels, v2 = _own_levels(cgroup_root, membership, "cpu.max", "cpu")
    quotas = [q for level in levels
              if (q := (_quota_v2(level) if v2 else _quota_v1(level))) is not None]
    return min(quotas, default=None)


def _quota_v2(level: Path) -> float | None:
    try:
        # "max 100000" or "<quota> <period>"
        quota, _, period = (level / "cpu.max").read_text().strip().partition(" ")
    except OSError:
        return None
    return None if quota == "max" else int(quota) / int(period or 100000)


def _quota_v1(level: Path) -> float | None:
    try:
        quota_us = int((level / "cpu.cfs_quota_us").read_text())
        period_us = int((level / "cpu.cfs_period_us").read_text())
    except (OSError, ValueError):
        return None
    return None if quota_us <= 0 or period_us <= 0 else quota_us / period_us


def cgroup_memory_room(cgroup_root: Path = CGROUP_ROOT,
                       membership: Path = MEMBERSHIP) -> int | None:
    """Bytes left under the memory cgroup's limit (v2 `memory.max`, v1
    `memory.limit_in_bytes`), or None when there is no limit: the least room over this
    process's cgroup and its ancestors (`_own_levels`).

    Usage counts like the kernel's working set, which the limit is enforced on after
    reclaim: the page cache the kernel could drop first (inactive file pages) is free.
    """
    levels, v2 = _own_levels(cgroup_root, membership, "memory.max", "memory")
    rooms = [r for level in levels if (r := _room(level, v2)) is not None]
    return min(rooms, default=None)


def _room(level: Path, v2: bool) -> int | None:
    if v2:
        files = (level / "memory.max", level / "memory.current", level / "memory.stat")
        inactive_key = "inactive_file"
    else:
        files = (level / "memory.limit_in_bytes", level / "memory.usage_in_bytes",
                 level / "memory.stat")
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
