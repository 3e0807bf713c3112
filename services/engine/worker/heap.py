"""The C heap of a serving process: memory a step frees stays for the next step.

Every step allocates and frees the same activations (tens of MB at a 2048-token chunk:
torch's CPU tensors come from malloc). glibc's defaults give much of that back to the
kernel between steps: a heap's free top is trimmed past a threshold that follows the
largest block freed so far, and each thread's arena shrinks the same way, so the next
step takes page faults to get the memory back, and on a VM a first touch is slow (~0.45
GB/s measured here). A 2048-token prefill of the benchmark checkpoint in process took
807 ms with the settings below against 864 ms without (medians of three runs each,
alternating; 2 cores, AMD EPYC). In a served engine protobuf also calls malloc_trim(0)
every 10,000 arena blocks it frees, which the settings cannot stop: the Session's
conversions (services/engine/server.py) make few arenas for that reason. During
benchmarks/pooling.py the engine took ~6,300 page faults a second before, ~1,850 with
these settings, ~1,000 with both.

So once the model is loaded and warm (what loading freed is handed back first), the
thresholds are fixed: blocks up to 32 MiB (glibc's largest mmap threshold) come from the
heap and are reused, and a heap keeps up to 1 GiB of free top. What must leave the
process at once (the KV cache of `sleep`) is handed back with `release_free_memory`.
Elsewhere than glibc (musl, macOS) both are no-ops.
"""

from __future__ import annotations

import ctypes
import logging

logger = logging.getLogger(__name__)

# mallopt(3) parameters (malloc.h).
M_TRIM_THRESHOLD = -1
M_TOP_PAD = -2
M_MMAP_THRESHOLD = -3

MMAP_THRESHOLD_BYTES = 32 << 20
TRIM_THRESHOLD_BYTES = 1 << 30
TOP_PAD_BYTES = 64 << 20


def _glibc() -> ctypes.CDLL | None:
    libc = ctypes.CDLL(None)
    if not hasattr(libc, "gnu_get_libc_version") or not hasattr(libc, "mallopt"):
        return None
    libc.mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    libc.malloc_trim.argtypes = [ctypes.c_size_t]
    return libc


def keep_freed_memory() -> bool:
    """Hand back what is free now, then keep what later steps free (see above). False
    where the C library is not glibc or refused a setting."""
    libc = _glibc()
    if libc is None:
        return False
    libc.malloc_trim(0)
    settings = ((M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES),
                (M_TRIM_THRESHOLD, TRIM_THRESHOLD_BYTES), (M_TOP_PAD, TOP_PAD_BYTES))
    if not all(libc.mallopt(param, value) == 1 for param, value in settings):
        logger.warning("mallopt refused a setting: freed memory may go back to the kernel "
                       "after each step")
        return False
    return True


def release_free_memory() -> None:
    """Give the kernel every free page of every heap (malloc_trim(0))."""
    libc = _glibc()
    if libc is not None:
        libc.malloc_trim(0)
