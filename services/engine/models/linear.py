"""`Linear`: the models' linear layer, whose weight may be packed for oneDNN on CPU.

`pack_linear_weights` packs every such weight of a loaded model once (see
kernels/cpu_linear.py for why); until then, and on CUDA, a layer is `nn.Linear`.
"""

from __future__ import annotations

import torch
from torch import nn

from kernels.cpu_linear import can_pack, linear, pack_weight


class Linear(nn.Linear):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias)


def pack_linear_weights(model: nn.Module) -> int:
    """Pack the weight of every `Linear` in `model` that oneDNN takes; the number packed.

    A weight another kind of module shares (tied embeddings: the lookup reads rows of
    it) stays as it is.
    """
    shared = {id(p) for m in model.modules() if not isinstance(m, Linear)
              for p in m.parameters(recurse=False)}
    packed = 0
    for module in model.modules():
        if isinstance(module, Linear) and id(module.weight) not in shared \
                and can_pack(module.weight):
            module.weight = nn.Parameter(pack_weight(module.weight), requires_grad=False)
            packed += 1
    return packed
