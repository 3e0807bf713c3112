"""Quantized weights for kernel tests: valid K-quant blocks, which no quantizer here
makes (gguf has none for them)."""

from __future__ import annotations

import torch
from corestream_kernels.quant import BLOCK_FORMATS, GGMLType, QuantizedWeight


def random_k_blocks(kind: GGMLType, out_features: int, in_features: int,
                    generator: torch.Generator) -> QuantizedWeight:
    """Valid K-quant blocks: random bytes, with f16 scale fields of a real model's size
    (gguf has no K-quant quantizer)."""
    values, size = BLOCK_FORMATS[kind]
    blocks = in_features // values
    raw = torch.randint(0, 256, (out_features, blocks, size), dtype=torch.uint8,
                        generator=generator)

    def f16(low: float, high: float) -> torch.Tensor:
        scale = torch.rand(out_features, blocks, generator=generator) * (high - low) + low
        return scale.half().view(torch.uint8).reshape(out_features, blocks, 2)

    if kind == GGMLType.Q6_K:
        raw[..., 208:210] = f16(1e-4, 2e-3)
    else:
        raw[..., 0:2] = f16(1e-4, 2e-3)  # d
        raw[..., 2:4] = f16(0.0, 2e-3)  # dmin
    return QuantizedWeight(raw.reshape(out_features, -1).contiguous(), kind, in_features,
                           out_features)
