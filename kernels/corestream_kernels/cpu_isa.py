"""Which instruction sets the CPU paths use, chosen at run time from the CPU's flags.

Three libraries pick a code path by the CPU: our C++ kernels (compiled on first use,
`corestream_kernels.cpu_extension`), oneDNN (torch's linear layers, packed weights) and ATen's own
vectorized kernels. Each asks the CPU itself, so a machine without AVX-512 runs the AVX2
code of all three. `CORESTREAM_CPU_ISA` caps all three at a lower level than the CPU has,
so that an AVX-512 machine runs, and its tests check, the code that older CPUs run:

- `auto` (default): what the CPU has (`-march=native`);
- `avx512`: AVX-512 F/BW/DQ/VL without the bf16 dot products (Skylake-SP, Cascade Lake);
- `avx2`: AVX2, FMA and F16C (Haswell to Zen 3: most cloud VMs);
- `baseline`: SSE2 only: the kernels' portable loops.

It is read once, and must act before torch is imported: oneDNN reads ONEDNN_MAX_CPU_ISA
and ATen reads ATEN_CPU_CAPABILITY when they first run. `apply_to_libraries` sets those
two from it (unless they are set already); the `corestream` command and the test suite
call it first thing, and child processes inherit the environment.

This module never imports torch.
"""

from __future__ import annotations

import functools
import os
import platform
from dataclasses import dataclass
from pathlib import Path

ENV = "CORESTREAM_CPU_ISA"
LEVELS = ("auto", "avx512", "avx2", "baseline")

# What each forced level needs of the CPU, and what it tells the compiler and libraries.
_NEEDS = {
    "avx512": frozenset({"avx512f", "avx512bw", "avx512dq", "avx512vl", "avx2", "fma"}),
    "avx2": frozenset({"avx2", "fma", "f16c"}),
    "baseline": frozenset(),
}
_MARCH = {"avx512": "x86-64-v4", "avx2": "x86-64-v3", "baseline": "x86-64"}
_ONEDNN = {"avx512": "AVX512_CORE", "avx2": "AVX2", "baseline": "SSE41"}
_ATEN = {"avx512": "avx512", "avx2": "avx2", "baseline": "default"}


@dataclass(frozen=True)
class CpuTarget:
    """The instruction sets the CPU paths of this process use."""

    level: str
    """`auto`, or the forced level (see the module docstring)."""
    name: str
    """What the kernels are built for, in words: "avx512_bf16", "avx512", "avx2",
    "baseline" (x86-64 without AVX2), or the machine's architecture elsewhere."""
    compile_flags: tuple[str, ...]
    """The C++ kernels' target flags."""
    x86: bool
    """Whether the C++ kernels are built here: they are written and tested for x86-64;
    elsewhere (aarch64) every op takes the torch path unless CORESTREAM_KERNELS=cpp."""


@functools.cache
def cpu_flags() -> frozenset[str]:
    """The flags of the first CPU in /proc/cpuinfo (empty where it cannot be read)."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return frozenset()
    for line in lines:
        key, _, value = line.partition(":")
        if key.strip() in ("flags", "Features"):
            return frozenset(value.split())
    return frozenset()


def requested_level() -> str:
    level = os.environ.get(ENV, "auto").strip().lower() or "auto"
    if level not in LEVELS:
        raise ValueError(f"{ENV}={level!r}; expected one of {', '.join(LEVELS)}")
    return level


def _native_name(flags: frozenset[str]) -> str:
    if _NEEDS["avx512"] <= flags:
        return "avx512_bf16" if "avx512_bf16" in flags else "avx512"
    return "avx2" if _NEEDS["avx2"] <= flags else "baseline"


@functools.cache
def target() -> CpuTarget:
    """This process's target, from `CORESTREAM_CPU_ISA` and the CPU (read once)."""
    level = requested_level()
    x86 = platform.machine() in ("x86_64", "AMD64")
    if not x86:
        return CpuTarget(level, platform.machine() or "unknown", ("-march=native",), False)
    flags = cpu_flags()
    if level == "auto":
        return CpuTarget(level, _native_name(flags), ("-march=native",), True)
    missing = _NEEDS[level] - flags
    if missing:
        raise ValueError(f"{ENV}={level} needs CPU flags this CPU lacks: "
                         f"{', '.join(sorted(missing))}")
    return CpuTarget(level, level, (f"-march={_MARCH[level]}", "-mtune=native"), True)


def apply_to_libraries(environ: os._Environ[str] | dict[str, str] = os.environ) -> None:
    """Cap oneDNN's and ATen's code paths at the forced level, if any; call before torch
    is imported. Variables already set are left as they are."""
    level = requested_level()
    if level == "auto":
        return
    environ.setdefault("ONEDNN_MAX_CPU_ISA", _ONEDNN[level])
    environ.setdefault("ATEN_CPU_CAPABILITY", _ATEN[level])
