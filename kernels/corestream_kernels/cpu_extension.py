"""The C++ kernels for CPU (`csrc/*.cpp`), compiled into one extension on first use.

The extension registers its ops under `torch.ops.corestream_cpu`: the decode attention
(`paged_decode`, see `corestream_kernels.cpu_paged_attention`) and the small per-layer ops
(`rms_norm`, `add_rms_norm`, `silu_and_mul`, `rotary_store_kv`, see `corestream_kernels.rms_norm`,
`corestream_kernels.activation` and `corestream_kernels.rotary`), all of them in a row for
every layer of a
decode-only step (`decode_layers`), and that with the embedding, the final norm and the head
(`decode_model`, see `corestream_kernels.decoder_layers`), and the linear layer of GGUF's quantized
weights (`quant_linear`, see `corestream_kernels.quant`). It is compiled with
torch.utils.cpp_extension the first time a CPU op needs it (or on `load()`), never at
import, and the build is cached on disk under TORCH_EXTENSIONS_DIR (default
~/.cache/torch_extensions), keyed by what it is built from (sources, CPU, flags, torch
version, compiler) and not by the checkout's path: one build serves every clone and
virtualenv on the machine, and a cached build is imported directly (under a second).
The first build says so in a line, since it takes minutes. If it cannot be built (no
compiler, no ninja, a compile error) every op runs its torch code; the failure is logged
once per process, or raised under `CORESTREAM_KERNELS=cpp` (`corestream_kernels.backend`). Threads
come from torch's intra-op pool (`torch.set_num_threads`).

The build targets the instruction sets `corestream_kernels.cpu_isa` chooses (the CPU's own, or a
lower level forced by CORESTREAM_CPU_ISA), and the sources pick their vector code by what
the compiler targets: AVX-512 (with or without the bf16 dot products), AVX2 with FMA, or
portable loops. Off x86-64 the extension is not built (nothing there has tested it), and
every op runs its torch code, unless CORESTREAM_KERNELS=cpp asks for it.
"""

from __future__ import annotations

import hashlib
import importlib.util
import logging
import os
import platform
import subprocess
import threading
import time
from pathlib import Path
from typing import Any

import torch

from corestream_kernels.backend import cpu_kernel_required, use_cpu_kernel
from corestream_kernels.cpu_isa import target

logger = logging.getLogger(__name__)

_CSRC = Path(__file__).with_name("csrc")
_SOURCES = (
    "paged_attention_cpu.cpp", "paged_prefill_cpu.cpp", "layers_cpu.cpp", "decoder_cpu.cpp",
    "linear_cpu.cpp",
    "quant_cpu.cpp",
)

DTYPES = (torch.float32, torch.bfloat16)
"""The dtypes every op of the extension supports; others take the torch path."""


def cache_dtype_supported(dtype: torch.dtype, cache_dtype: torch.dtype) -> bool:
    """Whether the attention and KV-cache ops take a cache of `cache_dtype` under activations
    of `dtype` (one of DTYPES): the same dtype, or float16 under float32."""
    return cache_dtype == dtype or (dtype == torch.float32 and cache_dtype == torch.float16)

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
    cpu = target()
    if not cpu.x86 and not cpu_kernel_required():
        raise RuntimeError(f"the C++ kernels are built for x86-64 only, not {cpu.name}")
    name = _extension_name()
    directory = _cache_root() / name
    built = directory / f"{name}.so"
    forced = "" if cpu.level == "auto" else f" ({cpu.level}, forced by CORESTREAM_CPU_ISA)"
    if (directory / _COMPLETE).exists() and built.exists():
        _module = _import_built(name, built)
        logger.info("CPU kernels loaded from %s, built for %s%s", directory, cpu.name, forced)
        return torch.ops.corestream_cpu
    from torch.utils import cpp_extension

    logger.warning(
        "compiling CPU kernels for %s%s: first start on this machine only, about %d "
        "minutes on %d cores; cached in %s", cpu.name, forced, _minutes_to_build(),
        os.cpu_count() or 1, directory)
    start = time.perf_counter()
    directory.mkdir(parents=True, exist_ok=True)
    # Imported as a Python module: its static initializers register the ops.
    _module = cpp_extension.load(
        name=name,
        sources=[str(_CSRC / source) for source in _SOURCES],
        extra_cflags=["-O3", *cpu.compile_flags, "-fopenmp"],
        # NOTE: links libgomp.so.1 by soname; torch has already loaded its own copy under
        # that soname, so the kernels' parallel regions share torch's OpenMP pool.
        extra_ldflags=["-fopenmp"],
        build_directory=str(directory),
        is_python_module=True,
    )
    # Written last, so that a build that died half way is never loaded as it is.
    (directory / _COMPLETE).write_text(f"{torch.__version__}\n")
    logger.info("CPU kernels ready in %.1fs, built for %s%s", time.perf_counter() - start,
                cpu.name, forced)
    return torch.ops.corestream_cpu


_COMPLETE = "complete"


def _cache_root() -> Path:
    # TORCH_EXTENSIONS_DIR as torch reads it, so that a container's cache setting holds.
    configured = os.environ.get("TORCH_EXTENSIONS_DIR")
    return Path(configured) if configured else Path.home() / ".cache" / "torch_extensions"


def _minutes_to_build() -> int:
    # Measured: 165 s on 2 cores (Zen 4) for four sources, and about 15 s more for
    # quant_cpu.cpp; more than 4 cores do not help.
    return max(1, round(360 / min(os.cpu_count() or 1, 4) / 60))


def _import_built(name: str, path: Path) -> Any:
    """The extension built earlier, by any checkout and virtualenv of the same torch:
    imported from its file, without torch's ninja step (which would rebuild it for a
    checkout whose paths differ from the builder's)."""
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot import the CPU kernels from {path}")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _compiler() -> str:
    compiler = os.environ.get("CXX", "c++")
    try:
        done = subprocess.run([compiler, "--version"], capture_output=True, text=True,
                              timeout=30, check=False)
    except (OSError, subprocess.TimeoutExpired):
        return compiler
    return f"{compiler} {done.stdout.splitlines()[0] if done.stdout else ''}"


def _extension_name() -> str:
    """The build's key: whatever makes one build differ from another, and nothing about
    where the checkout or its virtualenv lies, so that a second clone on this machine
    loads the first one's build instead of compiling (minutes) again."""
    # NOTE: -march=native code from one CPU can die with SIGILL on another (a shared home
    # directory, a copied container layer): the CPU's identity goes into the key. So do
    # the headers, whose changes torch's own cache would not notice, torch's version (the
    # extension links its C++ ABI) and the compiler.
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
    digest.update(f"{torch.__version__} {torch.compiled_with_cxx11_abi()}".encode())
    digest.update(_compiler().encode())
    for path in sorted(_CSRC.glob("*.[ch]*")):
        digest.update(path.name.encode() + path.read_bytes())
    return f"corestream_cpu_{digest.hexdigest()[:12]}"
