"""RMSNorm, alone and fused with the residual add before it.

Both normalize in float32 and cast back to the input's dtype before the scale, as
transformers' LlamaRMSNorm does. On CPU they run as one C++ op each
(`csrc/layers_cpu.cpp`; torch's own RMSNorm is six ops there), elsewhere as the torch
code below, which is also their reference.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from corestream_kernels.cpu_extension import DTYPES, cpu_ops


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """`weight * x / rms(x)` over the last dim, for x `[N, H]` or `[N, M, H]`, weight `[H]`."""
    if (
        x.dtype in DTYPES
        and weight.dtype == x.dtype
        and x.dim() in (2, 3)
        and x.stride(-1) == 1
        and (ops := cpu_ops(x)) is not None
    ):
        return ops.rms_norm(x, weight, eps)
    return rms_norm_torch(x, weight, eps)


def add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(rms_norm(residual + x), residual + x) for x and residual `[N, H]` of one dtype.

    Both inputs may be overwritten (the C++ op works in place on them): use the results.
    """
    if (
        x.dtype in DTYPES
        and residual.dtype == x.dtype
        and weight.dtype == x.dtype
        and x.dim() == 2
        and x.stride(-1) == 1
        and residual.stride(-1) == 1
        and (ops := cpu_ops(x)) is not None
    ):
        ops.add_rms_norm(x, residual, weight, eps)
        return x, residual
    residual = residual + x
    return rms_norm_torch(residual, weight, eps), residual


def rms_norm_torch(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    normed = F.rms_norm(x.float(), weight.shape, eps=eps)
    return weight * normed.to(x.dtype)
