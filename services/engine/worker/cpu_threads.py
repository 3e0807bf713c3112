"""How many threads the model's CPU operators get.

torch sizes its intra-op pool by the host's CPU count, which is wrong in the two places
an engine usually runs: in a container with a CPU limit (a 4-CPU pod on a 64-CPU node
would start 64 threads and spend its quota in a few milliseconds of every period), and
beside other engines on one machine (`corestream serve --engines N`). Parallel
operators split their work into equal shares and wait for the slowest thread, so one
thread that loses its CPU to another process stalls the whole operator for a scheduler
time slice: on a 2-CPU machine a 5 MB matrix-vector product went from 0.3 ms to 12 ms
with a second busy process. One thread per CPU that is really this process's avoids it.
"""

from __future__ import annotations

import ctypes
import logging
import math
import os
from pathlib import Path

from services.engine.worker.cgroup import CGROUP_ROOT, MEMBERSHIP, cgroup_cpu_quota

logger = logging.getLogger(__name__)


def usable_cpus(cgroup_root: Path = CGROUP_ROOT, membership: Path = MEMBERSHIP) -> int:
    """CPUs this process may run on (its affinity), capped by its cgroup's CPU quota."""
    cpus = len(os.sched_getaffinity(0))
    quota = cgroup_cpu_quota(cgroup_root, membership)
    if quota is not None:
        cpus = min(cpus, max(1, math.floor(quota)))
    return cpus


def threads_set_by_environment() -> bool:
    """Whether the operator chose the thread count with OMP_NUM_THREADS, which then stands."""
    return bool(os.environ.get("OMP_NUM_THREADS"))


def resolve_num_threads(requested: int) -> int | None:
    """`requested` threads; with 0 one per usable CPU, or None (leave torch's pool as it
    is) when the operator chose with OMP_NUM_THREADS."""
    if requested > 0:
        return requested
    return None if threads_set_by_environment() else usable_cpus()


# OpenMP runtimes that torch builds link: GNU's (Linux wheels), LLVM's and Intel's.
_OPENMP_LIBRARIES = ("libgomp", "libomp", "libiomp5")
_OMP_PAUSE_SOFT = 1


def release_openmp_pool(maps: Path = Path("/proc/self/maps")) -> bool:
    """Free the calling thread's OpenMP worker threads (OpenMP 5's
    `omp_pause_resource_all`) in every OpenMP runtime the process has loaded; whether
    any runtime did so.

    NOTE: libgomp keeps one pool of workers per thread that has run a parallel region,
    and once it manages more threads than there are CPUs it spins only ~100 times at a
    barrier before sleeping. The engine loads and warms its model on one thread and
    steps it on another (the busy loop), so without this its step's parallel regions
    ran throttled: on 2 CPUs a decode step made 105 futex sleeps instead of none, and
    took 4.9 ms instead of 3.9. Any later parallel region on the calling thread simply
    starts a new pool. Every runtime, not the first: wheels bundle their own (scikit-
    learn's libgomp, pulled in by sentence-transformers, sorts before torch's), and
    pausing one that holds no pool of ours succeeds while torch's pool stays.
    """
    try:
        lines = maps.read_text().splitlines()
    except OSError:
        return False
    # Each line: address, perms, offset, device, inode, and the mapped file's path if any.
    paths = {fields[5] for line in lines
             if len(fields := line.split(maxsplit=5)) == 6 and fields[5].startswith("/")}
    released = False
    for path in sorted(paths):
        if not Path(path).name.startswith(_OPENMP_LIBRARIES):
            continue
        try:
            pause = ctypes.CDLL(path).omp_pause_resource_all
        except (OSError, AttributeError):
            continue
        pause.argtypes, pause.restype = [ctypes.c_int], ctypes.c_int
        if pause(_OMP_PAUSE_SOFT) == 0:
            released = True
        else:
            logger.debug("%s: omp_pause_resource_all failed", path)
    return released
