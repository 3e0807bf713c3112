"""How much of a memory range is resident (committed pages): mincore(2).

The KV cache comes from calloc's fresh zero pages, which the kernel maps only when
first written, so its size says little about the memory it holds: sleep reports the
resident bytes it gives back, which is what a process's RSS loses.
"""

from __future__ import annotations

import ctypes
import mmap
import os

import numpy as np

_PAGE = mmap.PAGESIZE
_libc = ctypes.CDLL(None, use_errno=True)
_libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.POINTER(ctypes.c_ubyte)]


def resident_bytes(address: int, num_bytes: int) -> int:
    """Bytes of [address, address + num_bytes) on resident pages."""
    if num_bytes <= 0:
        return 0
    start = address - address % _PAGE
    length = address + num_bytes - start
    num_pages = -(-length // _PAGE)
    vec = (ctypes.c_ubyte * num_pages)()
    if _libc.mincore(ctypes.c_void_p(start), ctypes.c_size_t(length), vec) != 0:
        errno = ctypes.get_errno()
        raise OSError(errno, f"mincore: {os.strerror(errno)}")
    resident = np.frombuffer(vec, dtype=np.uint8) & 1
    # Whole pages, less the parts of the first and last outside the range.
    total = int(resident.sum()) * _PAGE
    total -= int(resident[0]) * (address - start)
    total -= int(resident[-1]) * (start + num_pages * _PAGE - (address + num_bytes))
    return total
