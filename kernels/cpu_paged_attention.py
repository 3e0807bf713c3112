"""The C++ decode-attention kernel for CPU (`csrc/paged_attention_cpu.cpp`), built on first use.

The torch decode path gathers every sequence's K and V blocks into dense tensors and then
runs SDPA over them, so it reads the context twice and writes it once; the kernel reads
each cached token once, in place. It is compiled with torch.utils.cpp_extension the first
time a CPU decode needs it (or on `warm_up()`), never at import, and the build is cached
on disk under TORCH_EXTENSIONS_DIR (default ~/.cache/torch_extensions). If it cannot be
built (no compiler, no ninja, a compile error) the caller gets None and uses torch; the
failure is logged once per process. Threads come from torch's intra-op pool
(`torch.set_num_threads`).
"""

from __future__ import annotations

import hashlib
import logging
import platform
import threading
import time
from collections.abc import Callable
from pathlib import Path

import torch

from kernels.backend import cpu_kernel_required, use_cpu_kernel

logger = logging.getLogger(__name__)

_SOURCE = Path(__file__).with_name("csrc") / "paged_attention_cpu.cpp"
# Mirror the C++ entry point's limits, so unsupported shapes take the torch path
# instead of raising.
_DTYPES = (torch.float32, torch.bfloat16)
_MAX_HEAD_DIM = 256
_MAX_HEADS = 256

# paged_decode(out, query, key_cache, value_cache, block_tables, seq_lens, scale, window):
# window is the sliding window in tokens, 0 for none.
DecodeFn = Callable[
    [
        torch.Tensor,
        torch.Tensor,
        torch.Tensor,
        torch.Tensor,
        torch.Tensor,
        torch.Tensor,
        float,
        int,
    ],
    None,
]

_lock = threading.Lock()
_kernel: DecodeFn | None = None
_failed = False


def cpu_decode_kernel(query: torch.Tensor, key_cache: torch.Tensor) -> DecodeFn | None:
    """The kernel's `paged_decode` if it applies to these tensors and builds, else None."""
    if not use_cpu_kernel(query):
        return None
    num_heads, head_dim = query.shape[1], query.shape[2]
    supported = (
        query.dtype in _DTYPES
        and key_cache.dtype == query.dtype
        and head_dim <= _MAX_HEAD_DIM
        and num_heads % key_cache.shape[2] == 0
        and num_heads <= _MAX_HEADS
        and key_cache.is_contiguous()
        and query.stride(-1) == 1
    )
    if not supported:
        return None
    return warm_up()


def warm_up() -> DecodeFn | None:
    """Build or load the extension once per process; its op, or None if it cannot be built."""
    global _kernel, _failed
    if _kernel is not None or (_failed and not cpu_kernel_required()):
        return _kernel
    with _lock:
        if _kernel is None and (not _failed or cpu_kernel_required()):
            try:
                _kernel = _build()
            except Exception as exc:  # any failure to build means: serve with torch
                if cpu_kernel_required():
                    raise
                _failed = True
                summary = str(exc).strip().splitlines()
                logger.warning(
                    "CPU paged-attention kernel unavailable, using the torch path: %s",
                    summary[0] if summary else type(exc).__name__,
                )
                logger.debug("CPU paged-attention kernel build failure", exc_info=True)
        return _kernel


def _build() -> DecodeFn:
    from torch.utils import cpp_extension

    start = time.perf_counter()
    # Loaded as a plain library: it registers the op corestream_cpu::paged_decode.
    cpp_extension.load(
        name=_extension_name(),
        sources=[str(_SOURCE)],
        extra_cflags=["-O3", "-march=native", "-fopenmp"],
        # NOTE: links libgomp.so.1 by soname; torch has already loaded its own copy under
        # that soname, so the kernel's parallel regions share torch's OpenMP pool.
        extra_ldflags=["-fopenmp"],
        is_python_module=False,
    )
    logger.info("CPU paged-attention kernel ready in %.1fs", time.perf_counter() - start)
    return torch.ops.corestream_cpu.paged_decode


def _extension_name() -> str:
    # NOTE: torch keys its on-disk build cache by name, sources and flags, not by CPU, and
    # -march=native code from one CPU can die with SIGILL on another (a shared home
    # directory, a copied container layer). The CPU's identity goes into the name.
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
        cpu = "\n".join(
            next((line for line in lines if line.startswith(key)), "")
            for key in ("model name", "flags")
        )
    except OSError:
        cpu = f"{platform.machine()} {platform.processor()}"
    return f"corestream_paged_attention_cpu_{hashlib.sha256(cpu.encode()).hexdigest()[:12]}"
