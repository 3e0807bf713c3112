"""Rotary position embedding (RoPE), half-split layout as in Llama checkpoints.

Frequencies follow the checkpoint's `rope_scaling`:
- none, or "linear" (every frequency slowed by `factor`);
- "llama3" (Llama 3.1): long wavelengths are slowed by `factor`, short ones kept, and
  the band between blended smoothly;
- "yarn" (Qwen2.5/Qwen3 long context): the same idea with the band given in rotations
  over the original context (`beta_fast`, `beta_slow`), plus a factor on cos and sin
  that makes up for the flatter attention of a longer context;
- "frequency_factors": one divisor per frequency pair, given as a list (`factors`). A
  GGUF file stores Llama 3.1's scaling this way (its `rope_freqs` tensor, which llama.cpp
  divides each pair's frequency by), not as the parameters it was computed from.
Other types ("dynamic" among them, whose frequencies depend on the current length)
are rejected when the model is built, not at its first forward.
cos/sin tables are built lazily on the device of the first input, because models are
constructed on the meta device.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "yarn", "frequency_factors")


def inverse_frequencies(
    head_dim: int, theta: float, scaling: dict[str, Any], max_positions: int
) -> tuple[torch.Tensor, float]:
    """[head_dim // 2] float32 angular frequencies, and the factor applied to cos and sin."""
    rope_type = scaling.get("rope_type", "default")
    if rope_type not in SUPPORTED_ROPE_TYPES:
        supported = ", ".join(SUPPORTED_ROPE_TYPES)
        raise ValueError(f"rope_type {rope_type!r} is not supported; supported: {supported}")
    if float(scaling.get("partial_rotary_factor", 1.0)) != 1.0:
        raise ValueError("partial_rotary_factor other than 1.0 is not supported")
    # Explicit device: construction runs under torch.device("meta"), and these are
    # computed once, now, so that a bad rope_scaling fails at load.
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64, device="cpu").float() / head_dim
    inv_freq = 1.0 / theta**exponents
    if rope_type == "default":
        return inv_freq, 1.0
    if rope_type == "linear":
        return inv_freq / float(scaling["factor"]), 1.0
    if rope_type == "llama3":
        return _llama3_frequencies(inv_freq, scaling), 1.0
    if rope_type == "frequency_factors":
        factors = torch.tensor(scaling["factors"], dtype=torch.float32, device="cpu")
        if factors.shape != inv_freq.shape:
            raise ValueError(f"rope frequency factors: {factors.numel()} given, the head "
                             f"size {head_dim} has {inv_freq.numel()} frequency pairs")
        return inv_freq / factors, 1.0
    return _yarn_frequencies(inv_freq, head_dim, theta, scaling, max_positions)


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


def _yarn_frequencies(
    inv_freq: torch.Tensor, head_dim: int, theta: float, scaling: dict[str, Any], max_positions: int
) -> tuple[torch.Tensor, float]:
    original_len = float(scaling["original_max_position_embeddings"])
    factor = float(scaling.get("factor") or max_positions / original_len)

    def pair_index(rotations: float) -> float:
        # The frequency pair that turns `rotations` times over the original context.
        return head_dim * math.log(original_len / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low = pair_index(float(scaling.get("beta_fast") or 32))
    high = pair_index(float(scaling.get("beta_slow") or 1))
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    if low == high:
        high += 0.001  # keeps the ramp below finite
    # 0 for pairs that turn often over the original context (kept as trained),
    # 1 for pairs that turn rarely (slowed by `factor`), linear in between.
    pairs = torch.arange(head_dim // 2, dtype=torch.float32, device="cpu")
    ramp = ((pairs - low) / (high - low)).clamp(0, 1)
    scaled = inv_freq / factor * ramp + inv_freq * (1 - ramp)

    attention_factor = scaling.get("attention_factor")
    if attention_factor is None:
        mscale, mscale_all_dim = scaling.get("mscale"), scaling.get("mscale_all_dim")
        if mscale and mscale_all_dim:
            attention_factor = _yarn_mscale(factor, mscale) / _yarn_mscale(factor, mscale_all_dim)
        else:
            attention_factor = _yarn_mscale(factor, 1.0)
    return scaled, float(attention_factor)


def _yarn_mscale(factor: float, mscale: float) -> float:
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


class RotaryEmbedding(nn.Module):
    def __init__(
        self, head_dim: int, max_positions: int, theta: float, scaling: dict[str, Any]
    ) -> None:
        super().__init__()
        self.max_positions = max_positions
        self.inv_freq, self.attention_factor = inverse_frequencies(
            head_dim, theta, scaling, max_positions
        )
        self._cos_sin: torch.Tensor | None = None

    def table(self, device: torch.device) -> torch.Tensor:
        """cos and sin of every position `[2, max_positions, head_dim]` (float32), in
        `cos_sin`'s layout; built on first use per device."""
        if self._cos_sin is None or self._cos_sin.device != device:
            positions = torch.arange(self.max_positions, dtype=torch.float32, device="cpu")
            angles = torch.outer(positions, self.inv_freq)
            cos, sin = angles.cos(), angles.sin()
            # Already in cos_sin's layout: a step then gathers its rows in one op, where
            # building the halves per step cost a gather, two concatenations and a
            # negation (about 20 us of a 5 ms single-stream decode step on CPU).
            table = torch.stack([torch.cat([cos, cos], dim=-1), torch.cat([-sin, sin], dim=-1)])
            # float32 on purpose: the angles of far positions lose digits in half precision.
            self._cos_sin = (table * self.attention_factor).to(device)
        return self._cos_sin

    def cos_sin(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin `[T, 1, head_dim]` (float32) for `positions` `[T]`, laid out for
        `corestream_kernels.rotary`: cos is `[cos, cos]` and sin is `[-sin, sin]` over the two
        halves.

        Built once per step, so that each layer's rotation is one op on CPU (the C++
        kernel) and a few whole-tensor ops elsewhere.
        """
        cos, sin = self.table(positions.device).index_select(1, positions)
        return cos[:, None], sin[:, None]

