"""SwiGLU's activation: silu(gate) * up over the fused gate/up projection's output.

One C++ op on CPU (`csrc/layers_cpu.cpp`), the torch code below elsewhere; that code is
also the reference.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from corestream_kernels.cpu_extension import DTYPES, cpu_ops


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """`[N, I]` silu(gate) * up for x `[N, 2I]`, gate then up along the last dim."""
    if x.dtype in DTYPES and x.dim() == 2 and x.stride(-1) == 1 and (ops := cpu_ops(x)) is not None:
        return ops.silu_and_mul(x)
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up
