"""`Linear`: the models' linear layer, whose weight may be packed for oneDNN on CPU.

`lay_out_for_cpu` gives every such weight of a loaded model its CPU layout once (see
kernels/cpu_linear.py for why); until then, and on CUDA, a layer is `nn.Linear`.
"""

from __future__ import annotations

import torch
from torch import nn

from kernels.cpu_linear import can_pack, linear, pack_weight, weight_panels


class Linear(nn.Linear):
    panels: torch.Tensor | None = None
    """The packed weight's bytes for the C++ few-row kernel (`weight_panels`), set by
    `lay_out_for_cpu` with the weight; not a buffer: it aliases the weight."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias, self.panels)


def lay_out_for_cpu(model: nn.Module) -> None:
    """Pack the weight of every `Linear` in `model` for oneDNN where it can, with its
    panels for the C++ few-row kernel where that runs; where it cannot (a torch without
    oneDNN), store a float32 one column-major instead.

    NOTE: MKL's float32 GEMM, which `F.linear` then calls, is up to 2-3x slower for 8-64
    rows (decode batches) when the weight comes transposed, which is how `F.linear`
    hands over a row-major one; column-major storage hands it an untransposed one, with
    the same values. bfloat16 gains nothing from that. A weight another kind of module
    shares (tied embeddings: the lookup reads its rows) stays as it is.
    """
    shared = {id(p) for m in model.modules() if not isinstance(m, nn.Linear)
              for p in m.parameters(recurse=False)}
    for module in model.modules():
        if not isinstance(module, Linear) or id(module.weight) in shared:
            continue
        weight = module.weight.detach()
        if can_pack(weight):
            packed = pack_weight(weight)
            module.weight = nn.Parameter(packed, requires_grad=False)
            module.panels = weight_panels(weight, packed)
        elif weight.dtype == torch.float32:
            module.weight = nn.Parameter(weight.t().contiguous().t(),
                                         requires_grad=module.weight.requires_grad)


def panels_of(model: nn.Module) -> list[torch.Tensor]:
    """The panels of every `Linear` in `model` that has them: the bytes a decode step
    streams through the C++ few-row kernel (they alias the packed weights)."""
    return [m.panels for m in model.modules() if isinstance(m, Linear) and m.panels is not None]
