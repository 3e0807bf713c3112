"""`Linear`: the models' linear layer, whose weight may be packed for oneDNN on CPU.

`lay_out_for_cpu` gives every such weight of a loaded model its CPU layout once (see
kernels/corestream_kernels/cpu_linear.py for why); until then, and on CUDA, a layer is `nn.Linear`.
A GGUF checkpoint's layers of a block type are `QuantizedLinear` instead (its embedding
table `QuantizedEmbedding`): they hold the file's blocks and never a float copy of them.
"""

from __future__ import annotations

from collections import Counter

import torch
from corestream_kernels.cpu_linear import (
    cpu_layout,
    is_panels_only,
    layout_name,
    linear,
    own_panels,
    unpack_panels,
)
from corestream_kernels.quant import QuantizedWeight, dequantize_blocks, quant_linear, weight_rows
from torch import nn


class Linear(nn.Linear):
    panels: torch.Tensor | None = None
    """The packed weight's bytes for the C++ few-row kernel (`weight_panels`), set by
    `lay_out_for_cpu` with the weight; not a buffer: it aliases the weight."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias, self.panels)


class QuantizedLinear(nn.Module):
    """A linear layer whose weight is a GGUF file's quantized blocks (`quant_linear`)."""

    def __init__(self, weight: QuantizedWeight, bias: torch.Tensor | None) -> None:
        super().__init__()
        self.weight = weight
        # The same bytes as a buffer: counted and listed with the model's tensors.
        self.register_buffer("blocks", weight.blocks, persistent=False)
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)
        self.in_features, self.out_features = weight.in_features, weight.out_features

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = quant_linear(x, self.weight)
        return y if self.bias is None else y + self.bias

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"{self.weight.ggml_type.name}, bias={self.bias is not None}")


class MixedQuantizedLinear(nn.Module):
    """A fused projection whose parts a file stores in different block types (a Q4_K_M
    file's q and k as Q5_0, v as Q8_0 in some layers): each part keeps its blocks, and
    the outputs are the parts' outputs side by side, in order."""

    def __init__(self, parts: list[QuantizedWeight], bias: torch.Tensor | None) -> None:
        super().__init__()
        assert len({p.in_features for p in parts}) == 1, "parts must share their inputs"
        self.parts = parts
        for i, part in enumerate(parts):
            self.register_buffer(f"blocks{i}", part.blocks, persistent=False)
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)
        self.in_features = parts[0].in_features
        self.out_features = sum(p.out_features for p in parts)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.cat([quant_linear(x, part) for part in self.parts], dim=-1)
        return y if self.bias is None else y + self.bias

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                + " + ".join(f"{p.out_features} {p.ggml_type.name}" for p in self.parts)
                + f", bias={self.bias is not None}")


class QuantizedEmbedding(nn.Module):
    """A token embedding table kept as quantized rows: a lookup dequantizes the rows it
    reads, into `dtype` (bit for bit the dequantized table's rows)."""

    def __init__(self, weight: QuantizedWeight, dtype: torch.dtype) -> None:
        super().__init__()
        self.weight = weight
        self.register_buffer("blocks", weight.blocks, persistent=False)
        self.dtype = dtype

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        rows = weight_rows(self.weight, input_ids)
        return dequantize_blocks(rows, self.weight.ggml_type).to(self.dtype)


def has_quantized_layers(model: nn.Module) -> bool:
    """Whether any linear layer of `model` holds quantized blocks (`QuantizedLinear`,
    `MixedQuantizedLinear`)."""
    return any(isinstance(m, QuantizedLinear | MixedQuantizedLinear) for m in model.modules())


def lay_out_for_cpu(model: nn.Module) -> Counter[str]:
    """Pack the weight of every `Linear` in `model` for oneDNN where it can, with its
    panels for the C++ few-row kernel where that runs; a bfloat16 weight oneDNN cannot
    take (a CPU without AVX-512) becomes panels alone, which the C++ kernel reads for
    every call; elsewhere (a torch without oneDNN) a float32 weight is stored
    column-major.

    NOTE: MKL's float32 GEMM, which `F.linear` then calls, is up to 2-3x slower for 8-64
    rows (decode batches) when the weight comes transposed, which is how `F.linear`
    hands over a row-major one; column-major storage hands it an untransposed one, with
    the same values. bfloat16 gains nothing from that. A weight another kind of module
    shares (tied embeddings: the lookup reads its rows) stays as it is, and the head gets
    panels of its own where the C++ kernel runs.

    Returns how many weights went which way (`layout_name`), for the load log.
    """
    shared = {id(p) for m in model.modules() if not isinstance(m, nn.Linear)
              for p in m.parameters(recurse=False)}
    layouts: Counter[str] = Counter()
    for module in model.modules():
        if isinstance(module, Linear):
            layouts[lay_out_linear(module, tied=id(module.weight) in shared)] += 1
    return layouts


def lay_out_linear(module: Linear, tied: bool = False) -> str:
    """Give one `Linear`'s plain weight its CPU layout (see `lay_out_for_cpu`); `tied`:
    another kind of module shares the weight, which then stays as it is. Returns the
    layout's name."""
    if tied:
        # Tied to the embedding table: a second copy, in panels, for the head alone.
        # Through F.linear the plain table streamed at under half the panels' speed
        # (SmolLM2-135M: a 113 MB float32 head, a fifth of every decode step's bytes).
        module.panels = own_panels(module.weight.detach())
        if module.panels is not None:
            return "tied head: C++ panels (a copy of the embedding)"
        return "tied head: torch (F.linear)"
    stored, module.panels = cpu_layout(module.weight.detach())
    module.weight = nn.Parameter(stored, requires_grad=False)
    return layout_name(stored, module.panels)


def plain_weight(module: Linear) -> torch.Tensor:
    """The `[out, in]` values of a `Linear`'s weight, whatever its layout (a view where
    it can be one; clone before writing)."""
    return plain_values(module.weight.detach(), module.panels)


def plain_values(weight: torch.Tensor, panels: torch.Tensor | None) -> torch.Tensor:
    """The `[out, in]` values of a weight stored as `cpu_layout` returns it (`weight`,
    `panels`)."""
    if panels is not None and (weight.is_mkldnn or is_panels_only(weight)):
        return unpack_panels(panels, *weight.shape)
    if weight.is_mkldnn:
        # Opaque to everything but oneDNN: multiplying the identity reads it back, exactly
        # (each output is one weight times 1 plus zeros).
        eye = torch.eye(weight.shape[1], dtype=weight.dtype)
        return linear(eye, weight).t().contiguous()
    return weight


def panels_of(model: nn.Module) -> list[torch.Tensor]:
    """The panels of every `Linear` in `model` that has them: the bytes a decode step
    streams through the C++ few-row kernel (they alias the packed weights, or are the
    weights)."""
    return [m.panels for m in model.modules() if isinstance(m, Linear) and m.panels is not None]


def linear_layers(model: nn.Module) -> list[tuple[torch.Tensor, torch.Tensor | None,
                                                  torch.Tensor | None]]:
    """(weight, bias, panels) of every `Linear` in `model`, as `linear` takes them."""
    return [(m.weight, m.bias, m.panels) for m in model.modules() if isinstance(m, Linear)]


def quantized_blocks(model: nn.Module) -> list[torch.Tensor]:
    """The blocks of every quantized layer of `model` (`QuantizedLinear`,
    `MixedQuantizedLinear`, `QuantizedEmbedding`): the rest of a decode step's bytes."""
    kinds = QuantizedLinear | MixedQuantizedLinear | QuantizedEmbedding
    return [b for m in model.modules() if isinstance(m, kinds)
            for b in m.buffers(recurse=False)]
