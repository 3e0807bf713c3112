"""CheckpointLayout: where each checkpoint tensor went when the model loaded.

Loading renames tensors, slices them for a tensor-parallel rank and concatenates
some into fused parameters (q/k/v into qkv_proj, each expert's projections into one
stacked tensor). A live weight update names tensors as the checkpoint does, so the
loader records the way back: every checkpoint tensor's full shape and stored dtype,
the model's name for it, and where in which parameter that name's rows landed.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

SAFETENSORS_DTYPES: dict[str, torch.dtype] = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8,
    "U8": torch.uint8, "BOOL": torch.bool,
}
"""safetensors' dtype names (`get_slice(name).get_dtype()`) as torch dtypes."""


@dataclass(frozen=True, slots=True)
class TensorSpec:
    """One checkpoint tensor as the checkpoint stores it."""

    shape: tuple[int, ...]
    dtype: torch.dtype
    model_name: str | None
    """The model's name for it (after renames); None when this rank does not read it
    (another expert-parallel rank's experts)."""


@dataclass(frozen=True, slots=True)
class Placement:
    """Where a model-named tensor (after sharding) sits: `param[index]`."""

    param: str
    index: tuple[int | slice, ...] = ()
    """() for the whole parameter; (slice,) for a fused projection's rows; (expert,
    slice) for one expert's rows of a stacked tensor."""


@dataclass(slots=True)
class CheckpointLayout:
    tensors: dict[str, TensorSpec] = field(default_factory=dict)
    """Checkpoint name -> spec, every tensor the loader read (or skipped as another
    rank's)."""
    placements: dict[str, Placement] = field(default_factory=dict)
    """Model name -> its place, for those fused or stacked; any other model name is
    a parameter of its own, whole."""
    source: str = ""
    """What the weights were read from, for messages ("safetensors", "gguf")."""

    def placement(self, model_name: str) -> Placement:
        return self.placements.get(model_name) or Placement(model_name)
