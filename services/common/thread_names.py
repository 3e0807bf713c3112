"""The OS sees each thread under its Python name, so `top -H`, `ps -L`, `perf` and
`/proc/<pid>/task/*/comm` tell engine-loop from a gRPC handler instead of showing
"python" for every thread. Python sets the native name itself only from 3.14.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import sys
import threading
from collections.abc import Callable

_PR_SET_NAME = 15
# The kernel keeps 15 bytes of a thread's name (16 with the terminating NUL).
_MAX_NAME_BYTES = 15


def _load_prctl() -> Callable[..., int] | None:
    if not sys.platform.startswith("linux"):
        return None
    try:
        return ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True).prctl
    except (OSError, AttributeError):
        return None


_prctl = _load_prctl()


def name_native_thread() -> None:
    """Give the calling thread's OS thread its Python name; a no-op off Linux. Call it
    first thing in a thread's target, or pass it as a ThreadPoolExecutor's initializer."""
    if _prctl is None:
        return
    name = threading.current_thread().name.encode(errors="replace")[:_MAX_NAME_BYTES]
    _prctl(_PR_SET_NAME, ctypes.c_char_p(name), 0, 0, 0)


def native_thread_name(tid: int | None = None) -> str:
    """The OS's name of a thread of this process (the calling one by default)."""
    tid = threading.get_native_id() if tid is None else tid
    with open(f"/proc/self/task/{tid}/comm") as f:
        return f.read().strip()
