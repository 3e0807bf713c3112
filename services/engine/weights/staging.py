"""WeightStaging: a live update's tensors, checked and held beside the serving weights
until the update commits, then swapped in between two steps.

An update names tensors as the checkpoint does (the model's `CheckpointLayout`). Each
is checked against the checkpoint's spec (known name, same shape, a floating dtype),
cut to this rank's tensor-parallel shard, converted to the model's dtype and device,
and kept; the serving weights are not touched until `commit`. At the end of each
staging call (`prepare`, still off the busy loop) every changed parameter is built
anew (a fused one from its current values with the new rows written in) in the layout
it serves in: linear weights packed for oneDNN with their panels, a tied head's own
panels. `commit`, on the loop thread between two steps, then only swaps them all in,
so an update that fails anywhere before the swap leaves the model exactly as it was;
the C++ decode op is bound anew to the new tensors on its next call.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from dataclasses import dataclass

import torch
from corestream_kernels.cpu_linear import cpu_layout, own_panels
from torch import nn

from services.engine.models.checkpoint_layout import CheckpointLayout, TensorSpec
from services.engine.models.linear import (
    Linear,
    has_quantized_layers,
    plain_values,
    plain_weight,
)
from services.engine.models.tp_sharding import ShardPlan

logger = logging.getLogger(__name__)

# Precomputed RoPE tables of old checkpoints: ours come from the config (the loader
# skips them too).
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)
_EMBEDDING = "model.embed_tokens.weight"


class WeightUpdateError(ValueError):
    """An update the model cannot take; the message names the tensor."""


class MixedWeightsError(RuntimeError):
    """Some tensor-parallel ranks swapped their new weights in and others did not: the
    model mixes two versions, and the engine must not serve on."""


@dataclass(frozen=True, slots=True)
class WantedTensor:
    """One tensor an update announces: its checkpoint name, dtype and full shape."""

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]


def why_not_updatable(model: nn.Module) -> str:
    """Why `model`'s weights cannot be updated live; "" when they can."""
    layout: CheckpointLayout | None = getattr(model, "checkpoint_layout", None)
    if layout is None or not layout.tensors:
        return (f"{type(model).__name__} records no checkpoint layout: its weights were not "
                "read from a safetensors checkpoint")
    if layout.source == "gguf":
        return ("the weights come from a GGUF file; live updates take a safetensors "
                "checkpoint's tensors (serve one in Hugging Face layout to update it)")
    if has_quantized_layers(model):
        return ("the linear weights are quantized (int8); live updates replace float "
                "weights (serve without --quantization to update them)")
    return ""


class WeightStaging:
    def __init__(self, model: nn.Module, dtype: torch.dtype, device: torch.device) -> None:
        why = why_not_updatable(model)
        if why:
            raise WeightUpdateError(f"this engine cannot update its weights: {why}")
        self._model = model
        self._layout: CheckpointLayout = model.checkpoint_layout
        self._dtype = dtype
        self._device = device
        tp = getattr(model, "tp", None)
        self._plan = (ShardPlan(model.config, tp.rank, tp.world_size)  # type: ignore[arg-type]
                      if tp is not None else None)
        self._params = dict(model.named_parameters(remove_duplicate=False))
        self._tied = bool(getattr(getattr(model, "config", None), "tie_word_embeddings", False))
        self._staged: dict[str, torch.Tensor] = {}
        """Tensors taken and not yet prepared, by our name."""
        self._prepared: dict[str, _Prepared] = {}
        self._head_panels: torch.Tensor | None = None
        self.num_tensors = 0
        """Checkpoint tensors taken so far (this rank's share of each)."""
        self.num_bytes = 0
        """Bytes of those tensors as they arrived (full, before sharding)."""

    def check(self, wanted: WantedTensor) -> TensorSpec | None:
        """The spec of a tensor the update may carry; None for one it may carry but that
        changes nothing here (a RoPE table, a tied head, another rank's experts).
        Raises WeightUpdateError for one the model does not have or that does not fit."""
        name = wanted.name
        if name.endswith(_IGNORED_SUFFIXES) or (self._tied and name == "lm_head.weight"):
            return None
        spec = self._layout.tensors.get(name)
        if spec is None:
            examples = ", ".join(list(self._layout.tensors)[:3])
            raise WeightUpdateError(
                f"tensor {name!r}: the model has no such tensor (its checkpoint has "
                f"{len(self._layout.tensors)}, e.g. {examples})")
        if wanted.shape != spec.shape:
            raise WeightUpdateError(
                f"tensor {name!r}: shape {list(wanted.shape)} differs from the checkpoint's "
                f"{list(spec.shape)}")
        if not wanted.dtype.is_floating_point:
            raise WeightUpdateError(
                f"tensor {name!r}: dtype {str(wanted.dtype).removeprefix('torch.')} is not "
                f"a floating-point type (the checkpoint stores "
                f"{str(spec.dtype).removeprefix('torch.')})")
        return spec if spec.model_name is not None else None

    def check_all(self, wanted: Iterable[WantedTensor]) -> None:
        """Check a whole announced update before any of it arrives."""
        for tensor in wanted:
            self.check(tensor)

    def add(self, name: str, tensor: torch.Tensor) -> None:
        """Take one checkpoint tensor (copied: the caller may reuse its buffer)."""
        spec = self.check(WantedTensor(name, tensor.dtype, tuple(tensor.shape)))
        self.num_tensors += 1
        self.num_bytes += tensor.numel() * tensor.element_size()
        if spec is None:
            return
        ours = spec.model_name
        assert ours is not None
        with torch.inference_mode():
            shard = tensor if self._plan is None else self._plan.read(ours, tensor, spec.shape)
            shard = shard.to(device=self._device, dtype=self._dtype, copy=True)
        placement = self._layout.placement(ours)
        param = self._params.get(placement.param)
        if param is None:
            raise WeightUpdateError(f"tensor {name!r}: its parameter {placement.param!r} "
                                    "is not in the model")
        target = torch.empty(param.shape, device="meta")[placement.index].shape
        if shard.shape != target:
            raise WeightUpdateError(
                f"tensor {name!r}: this rank's part has shape {list(shard.shape)}, where "
                f"{placement.param} takes {list(target)}")
        self._staged[ours] = shard

    def prepare(self, final: bool = False) -> None:
        """Build the new value of every parameter the tensors taken so far change, in
        the layout it serves in, beside the serving one: the costly part of an update
        (a fused parameter's current values read back, oneDNN packing, panels), done on
        the staging thread while the engine serves on, so that `commit` only swaps.
        A parameter that sleep level 2 dropped waits for `final` (the commit): its parts
        may arrive over several calls, and only then must they cover it."""
        pieces: dict[str, list[tuple[tuple[int | slice, ...], torch.Tensor]]] = {}
        for ours, shard in self._staged.items():
            placement = self._layout.placement(ours)
            pieces.setdefault(placement.param, []).append((placement.index, shard))
        waiting: dict[str, torch.Tensor] = {}
        with torch.inference_mode():
            for param, parts in pieces.items():
                module, attr = self._module_of(param)
                if (not final and param not in self._prepared
                        and getattr(module, attr).is_meta):
                    waiting.update((o, t) for o, t in self._staged.items()
                                   if self._layout.placement(o).param == param)
                    continue
                value = self._new_value(param, module, attr, parts)
                if isinstance(module, Linear) and attr == "weight" and value.device.type == "cpu":
                    self._prepared[param] = _Prepared(*cpu_layout(value), linear=True)
                else:
                    self._prepared[param] = _Prepared(value, None,
                                                      linear=isinstance(module, Linear))
            embedding = self._prepared.get(_EMBEDDING)
            head = getattr(self._model, "lm_head", None)
            if (self._tied and _EMBEDDING in pieces and embedding is not None
                    and isinstance(head, Linear) and embedding.stored.device.type == "cpu"):
                # Tied to the embedding table: the head serves from panels of its own.
                self._head_panels = own_panels(embedding.stored)
        self._staged = waiting

    def commit(self) -> list[str]:
        """Swap every prepared parameter into the model; returns the parameters
        replaced. Call it between steps, with no forward running."""
        self.prepare(final=True)
        self._check_covers_dropped(self._prepared)
        with torch.inference_mode():
            for param, prepared in self._prepared.items():
                module, attr = self._module_of(param)
                setattr(module, attr, nn.Parameter(prepared.stored, requires_grad=False))
                if prepared.linear and attr == "weight":
                    module.panels = prepared.panels
            if self._tied and _EMBEDDING in self._prepared:
                self._model.tie_weights()
                head = self._model.lm_head
                if isinstance(head, Linear):
                    head.panels = self._head_panels
        self._model.model.forget_decode_op()
        replaced = sorted(self._prepared)
        self._prepared.clear()
        return replaced

    def _module_of(self, param: str) -> tuple[nn.Module, str]:
        module_name, _, attr = param.rpartition(".")
        return self._model.get_submodule(module_name), attr

    def _check_covers_dropped(self, values: Iterable[str]) -> None:
        """An update while sleep level 2 has dropped the weights must bring back all of
        them: a model with a parameter missing cannot run."""
        given = set(values)
        if self._tied and _EMBEDDING in given:
            given.add("lm_head.weight")
        missing = [name for name in dropped_parameters(self._model) if name not in given]
        if missing:
            raise WeightUpdateError(
                f"the weights were dropped (sleep level 2) and this update does not replace "
                f"{len(missing)} of them (e.g. {missing[0]!r}): send every tensor, or wake "
                "the weights first (which reloads the checkpoint)")

    def _new_value(self, param: str, module: nn.Module, attr: str,
                   parts: list[tuple[tuple[int | slice, ...], torch.Tensor]]) -> torch.Tensor:
        whole = [shard for index, shard in parts if index == ()]
        if whole:
            return whole[-1]
        earlier = self._prepared.get(param)
        if earlier is not None:  # an earlier call of this update changed other parts
            current = plain_values(earlier.stored, earlier.panels)
        elif isinstance(module, Linear) and attr == "weight":
            current = plain_weight(module)
        else:
            current = getattr(module, attr).detach()
        if current.is_meta:
            # Dropped by sleep level 2: this update must write every part of it.
            value = torch.empty(current.shape, dtype=self._dtype, device=self._device)
            if sum(value[index].numel() for index, _ in parts) != value.numel():
                raise WeightUpdateError(
                    f"parameter {param!r} was dropped (sleep level 2) and this update "
                    "carries only some of the tensors it is made of: send all of them")
        else:
            value = current.clone()
        for index, shard in parts:
            value[index] = shard
        return value


@dataclass(slots=True)
class _Prepared:
    """A parameter's new value as it will serve: stored (plain, packed or a panels-only
    stand-in) and, for a CPU linear weight, the panels the C++ kernel reads."""

    stored: torch.Tensor
    panels: torch.Tensor | None
    linear: bool


def drop_weights(model: nn.Module) -> int:
    """Free every parameter of `model` (sleep level 2), keeping each one's shape and dtype
    on the meta device, for the update or reload that must follow; returns the
    parameters' bytes. Derived layouts (panels, the C++ decode op's binding) go too."""
    freed = 0
    seen: set[int] = set()
    for name, param in list(model.named_parameters(remove_duplicate=False)):
        module_name, _, attr = name.rpartition(".")
        module = model.get_submodule(module_name)
        if id(param) not in seen and not param.is_meta:
            seen.add(id(param))
            freed += param.numel() * param.element_size()
        if isinstance(module, Linear):
            module.panels = None
        placeholder = torch.empty(param.shape, dtype=param.dtype, device="meta")
        setattr(module, attr, nn.Parameter(placeholder, requires_grad=False))
    model.model.forget_decode_op()
    return freed


def dropped_parameters(model: nn.Module) -> list[str]:
    """The parameters `drop_weights` freed that no update has brought back."""
    return [name for name, param in model.named_parameters(remove_duplicate=False)
            if param.is_meta]
