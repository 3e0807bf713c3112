"""Rotary position embedding (RoPE), half-split layout as in Llama checkpoints.

Frequencies follow the checkpoint's `rope_scaling`: none, "linear", or "llama3"
(Llama 3.1's piecewise scaling: long wavelengths are slowed by `factor`, short ones
kept, and the band between blended smoothly). cos/sin tables are built lazily on
the device of the first input, because models are constructed on the meta device.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn


def inverse_frequencies(head_dim: int, theta: float, scaling: dict[str, Any]) -> torch.Tensor:
    """[head_dim // 2] float32 angular frequencies."""
    inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim)
    rope_type = scaling.get("rope_type", "default")
    if rope_type == "default":
        return inv_freq
    if rope_type == "linear":
        return inv_freq / float(scaling["factor"])
    if rope_type == "llama3":
        return _llama3_frequencies(inv_freq, scaling)
    raise NotImplementedError(f"rope_type {rope_type!r} is not supported")


def _llama3_frequencies(inv_freq: torch.Tensor, scaling: dict[str, Any]) -> torch.Tensor:
    factor = float(scaling["factor"])
    low_factor = float(scaling.get("low_freq_factor", 1.0))
    high_factor = float(scaling.get("high_freq_factor", 4.0))
    original_len = float(scaling["original_max_position_embeddings"])
    wavelen = 2 * math.pi / inv_freq
    # Wavelengths longer than the original context cannot have been learned precisely:
    # stretch them fully; those much shorter carry local order: keep them.
    slowed = torch.where(wavelen > original_len / low_factor, inv_freq / factor, inv_freq)
    blend = (original_len / wavelen - low_factor) / (high_factor - low_factor)
    blended = (1 - blend) * slowed / factor + blend * slowed
    in_band = (wavelen >= original_len / high_factor) & (wavelen <= original_len / low_factor)
    return torch.where(in_band, blended, slowed)


class RotaryEmbedding(nn.Module):
    def __init__(
        self, head_dim: int, max_positions: int, theta: float, scaling: dict[str, Any]
    ) -> None:
        super().__init__()
        self.head_dim = head_dim
        self.max_positions = max_positions
        self.theta = theta
        self.scaling = scaling
        self._cos_sin: torch.Tensor | None = None

    def _table(self, device: torch.device) -> torch.Tensor:
        if self._cos_sin is None or self._cos_sin.device != device:
            inv_freq = inverse_frequencies(self.head_dim, self.theta, self.scaling)
            positions = torch.arange(self.max_positions, dtype=torch.float32)
            angles = torch.outer(positions, inv_freq)
            # float32 on purpose: the angles of far positions lose digits in half precision.
            self._cos_sin = torch.stack([angles.cos(), angles.sin()]).to(device)
        return self._cos_sin

    def cos_sin(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin `[T, head_dim // 2]` (float32) for `positions` `[T]`."""
        table = self._table(positions.device)[:, positions]
        return table[0], table[1]


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate x `[T, heads, head_dim]`: the first and second halves are the pairs."""
    first, second = x.float().chunk(2, dim=-1)
    cos, sin = cos[:, None, :], sin[:, None, :]
    rotated = torch.cat([first * cos - second * sin, second * cos + first * sin], dim=-1)
    return rotated.to(x.dtype)
