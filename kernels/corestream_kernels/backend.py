"""Choosing between the compiled kernels and the torch implementations.

The entry points (`write_kv_cache`, `paged_attention`) run Triton when their tensors
are on CUDA and triton can be imported; on CPU, `paged_attention` runs its decodes, and
`rms_norm`, `add_rms_norm`, `silu_and_mul` and `rotate_and_store_kv` run entirely,
through C++ kernels built on first use (`corestream_kernels.cpu_extension`), and fall back to
torch, after one warning, if that build fails. Everything else runs torch.

`CORESTREAM_KERNELS` (read once, at import) or `set_backend` picks the policy:
- `auto`: as above;
- `torch`: torch everywhere, e.g. to rule the compiled kernels out while debugging;
- `cpp`: as `auto`, but a failed CPU kernel build raises instead of falling back, so
  tests and benchmarks cannot pass on the torch path by accident.

Nothing here imports triton or builds anything: importing `kernels` must stay cheap
and work on CPU-only machines without a compiler.
"""

from __future__ import annotations

import functools
import importlib.util
import os

import torch

_BACKENDS = ("auto", "torch", "cpp")
_backend = os.environ.get("CORESTREAM_KERNELS", "auto")
if _backend not in _BACKENDS:
    raise ValueError(f"CORESTREAM_KERNELS={_backend!r}; expected one of {_BACKENDS}")


def set_backend(name: str) -> None:
    global _backend
    if name not in _BACKENDS:
        raise ValueError(f"backend {name!r}; expected one of {_BACKENDS}")
    _backend = name


def get_backend() -> str:
    return _backend


def force_torch(enabled: bool) -> None:
    """Run the torch implementations everywhere (True), or choose per device (False)."""
    set_backend("torch" if enabled else "auto")


@functools.cache
def triton_available() -> bool:
    return importlib.util.find_spec("triton") is not None


def use_triton(tensor: torch.Tensor) -> bool:
    return tensor.is_cuda and _backend != "torch" and triton_available()


def use_cpu_kernel(tensor: torch.Tensor) -> bool:
    # is_cpu, not device.type: this runs several times per layer, and building the
    # device object costs more than the check.
    return tensor.is_cpu and _backend != "torch"


def cpu_kernel_required() -> bool:
    return _backend == "cpp"
