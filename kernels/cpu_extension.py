"""The C++ kernels for CPU (`csrc/*.cpp`), compiled into one extension on first use.

The extension registers its ops under `torch.ops.corestream_cpu`: the decode attention
(`paged_decode`, see `kernels.cpu_paged_attention`) and the small per-layer ops
(`rms_norm`, `add_rms_norm`, `silu_and_mul`, `rotary_store_kv`, see `kernels.rms_norm`,
`kernels.activation` and `kernels.rotary`), all of them in a row for every layer of a
decode-only step (`decode_layers`), and that with the embedding, the final norm and the head
(`decode_model`, see `kernels.decoder_layers`). It is compiled with
torch.utils.cpp_extension the first time a CPU op needs it (or on `load()`), never at
import, and the build is cached on disk under TORCH_EXTENSIONS_DIR (default
~/.cache/torch_extensions). If it cannot be built (no compiler, no ninja, a compile error)
every op runs its torch code; the failure is logged once per process, or raised under
`CORESTREAM_KERNELS=cpp` (`kernels.backend`). Threads come from torch's intra-op pool
(`torch.set_num_threads`).

The build targets the instruction sets `kernels.cpu_isa` chooses (the CPU's own, or a
lower level forced by CORESTREAM_CPU_ISA), and the sources pick their vector code by what
the compiler targets: AVX-512 (with or without the bf16 dot products), AVX2 with FMA, or
portable loops. Off x86-64 the extension is not built (nothing there has tested it), and
every op runs its torch code, unless CORESTREAM_KERNELS=cpp asks for it.
"""

from __future__ import annotations

import hashlib
import logging
import platform
import threading
import time
from pathlib import Path
from typing import Any

import torch

from kernels.backend import cpu_kernel_required, use_cpu_kernel
from kernels.cpu_isa import target

logger = logging.getLogger(__name__)

_CSRC = Path(__file__).with_name("csrc")
_SOURCES = (
    "paged_attention_cpu.cpp", "layers_cpu.cpp", "decoder_cpu.cpp", "linear_cpu.cpp",
)

DTYPES = (torch.float32, torch.bfloat16)
"""The dtypes every op of the extension supports; others take the torch path."""

_lock = threading.Lock()
_ops: Any = None  # torch.ops.corestream_cpu once built
_module: Any = None  # the extension as a Python module (its pybind11 classes) once built
_failed = False


def cpu_ops(tensor: torch.Tensor) -> Any:
    """`torch.ops.corestream_cpu` if the C++ kernels may run on `tensor` (a CPU tensor,
    backend not "torch") and the extension builds; else None."""
    if not use_cpu_kernel(tensor):
        return None
    return _ops if _ops is not None else load()


def load() -> Any:
    """Build or load the extension once per process: its op namespace, or None."""
    global _ops, _failed
    if _ops is not None or (_failed and not cpu_kernel_required()):
        return _ops
    with _lock:
        if _ops is None and (not _failed or cpu_kernel_required()):
            try:
                _ops = _build()
            except Exception as exc:  # any failure to build means: serve with torch
                if cpu_kernel_required():
                    raise
                _failed = True
                summary = str(exc).strip().splitlines()
                logger.warning(
                    "CPU kernels unavailable, using the torch path: %s",
                    summary[0] if summary else type(exc).__name__,
                )
                logger.debug("CPU kernel build failure", exc_info=True)
        return _ops


def python_module() -> Any:
    """The extension as a Python module, for what it binds with pybind11 rather than as
    ops (`DecodeModel`); None unless `load()` built it."""
    return _module


def _build() -> Any:
    global _module
    from torch.utils import cpp_extension

    cpu = target()
    if not cpu.x86 and not cpu_kernel_required():
        raise RuntimeError(f"the C++ kernels are built for x86-64 only, not {cpu.name}")
    start = time.perf_counter()
    # Imported as a Python module: its static initializers register the ops.
    _module = cpp_extension.load(
        name=_extension_name(),
        sources=[str(_CSRC / source) for source in _SOURCES],
        extra_cflags=["-O3", *cpu.compile_flags, "-fopenmp"],
        # NOTE: links libgomp.so.1 by soname; torch has already loaded its own copy under
        # that soname, so the kernels' parallel regions share torch's OpenMP pool.
        extra_ldflags=["-fopenmp"],
        is_python_module=True,
    )
    forced = "" if cpu.level == "auto" else f" ({cpu.level}, forced by CORESTREAM_CPU_ISA)"
    logger.info("CPU kernels ready in %.1fs, built for %s%s", time.perf_counter() - start,
                cpu.name, forced)
    return torch.ops.corestream_cpu


def _extension_name() -> str:
    # NOTE: torch keys its on-disk build cache by name, sources and flags, not by CPU, and
    # -march=native code from one CPU can die with SIGILL on another (a shared home
    # directory, a copied container layer): the CPU's identity goes into the name. So do
    # the headers, whose changes torch's cache would not notice.
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
        cpu = "\n".join(
            next((line for line in lines if line.startswith(key)), "")
            for key in ("model name", "flags")
        )
    except OSError:
        cpu = f"{platform.machine()} {platform.processor()}"
    digest = hashlib.sha256(cpu.encode())
    digest.update(" ".join(target().compile_flags).encode())
    # And the torch it is built against, by version and place: torch's ninja file names the
    # include and library paths of that torch and the sources' paths, so two checkouts with
    # a virtualenv each, sharing one build directory, would recompile it in turn (a minute
    # each time on 2 cores); with the torch in the name, each gets its own.
    digest.update(f"{torch.__version__} {Path(torch.__file__).parent}".encode())
    for path in sorted(_CSRC.glob("*.[ch]*")):
        digest.update(path.name.encode() + path.read_bytes())
    return f"corestream_cpu_{digest.hexdigest()[:12]}"
