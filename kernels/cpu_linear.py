"""Linear layers on CPU through oneDNN, with each weight reordered once, at load.

`F.linear` on CPU sends float32 to MKL's sgemm, whose fast paths are Intel's: on an AMD
EPYC (AVX-512, no AMX) it reached 14-127 GFLOP/s on a small Llama's projections, where
oneDNN's matmul on a weight already in its blocked layout reached 21-180, 1.4-3x
faster at 1-2048 rows. bfloat16 already runs on oneDNN through `F.linear`, but
reorders the weight on every call; packed once it is 1.1-2x faster at decode batch
sizes (whole steps: benchmarks/cpu_linear.py). So the model's linear weights are packed
at load (`pack_weight`), and every linear layer, the C++ decode op's included, calls
`linear`, which takes either kind of weight.

A packed weight is an opaque oneDNN tensor: it keeps its shape and dtype but has no
strides or storage, so only `linear` may read it.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

PACKED_DTYPES = (torch.float32, torch.bfloat16)


def can_pack(weight: torch.Tensor) -> bool:
    """Whether `weight` `[out, in]` is a CPU weight oneDNN can take packed."""
    return (
        weight.device.type == "cpu"
        and weight.dim() == 2
        and weight.dtype in PACKED_DTYPES
        and not weight.is_mkldnn
        and torch.backends.mkldnn.is_available()
    )


def pack_weight(weight: torch.Tensor) -> torch.Tensor:
    """`weight` `[out, in]` in oneDNN's blocked layout for any number of input rows."""
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach())


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None
           ) -> torch.Tensor:
    """`x @ weight.T + bias` for a plain or a packed weight."""
    if weight.is_mkldnn:
        return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")
    return F.linear(x, weight, bias)
