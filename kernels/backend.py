"""Choosing between the Triton kernels and the torch implementations.

The entry points (`write_kv_cache`, `paged_attention`) run Triton when their tensors
are on CUDA and triton can be imported, and torch otherwise. `CORESTREAM_KERNELS=torch`
(read once, at import) or `force_torch(True)` pins them to torch, e.g. to rule the
Triton kernels out while debugging. Nothing here imports triton: importing `kernels`
must work on CPU-only machines without it.
"""

from __future__ import annotations

import functools
import importlib.util
import os

import torch

_BACKENDS = ("auto", "torch")
_backend = os.environ.get("CORESTREAM_KERNELS", "auto")
if _backend not in _BACKENDS:
    raise ValueError(f"CORESTREAM_KERNELS={_backend!r}; expected one of {_BACKENDS}")


def force_torch(enabled: bool) -> None:
    """Run the torch implementations even on CUDA (True), or choose per device (False)."""
    global _backend
    _backend = "torch" if enabled else "auto"


@functools.cache
def triton_available() -> bool:
    return importlib.util.find_spec("triton") is not None


def use_triton(tensor: torch.Tensor) -> bool:
    return tensor.is_cuda and _backend == "auto" and triton_available()
