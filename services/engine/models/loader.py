"""Build a model from a Hugging Face checkpoint folder: config.json + safetensors shards.

The model is constructed on the meta device and its parameters are replaced by the
checkpoint tensors (`assign=True`), so weights are never allocated twice. The
architecture named in config.json picks the class through `registry.MODEL_REGISTRY`,
which names modules rather than importing them, so a new family is one line plus a module.
The class also reads the config (`config_from_hf`), since families spell the same
switches differently, and names the projections it runs fused (`packed_projections`):
their checkpoint tensors are concatenated as they are read, each part freed once packed.
Mixture-of-experts classes also stack each layer's per-expert tensors (`packed_experts`),
rename modules their checkpoints name differently (`checkpoint_renames`), and, when the
experts are split over DP ranks, say which ones this rank holds (`local_experts`): the
others are never read.
A model sharded over a tensor-parallel group (its `tp`, from `current_tp_group`) reads
only this rank's slice of each tensor (`tp_sharding.ShardPlan`, through safetensors'
`get_slice`), before the packing above, so a rank never holds the whole model.
A GGUF view (config.json names its file, `GGUF_FILE_KEY`) reads the tensors from that file
instead (`gguf_weights.read_gguf`), under the same names, so all of the above applies;
its linear weights of a block type stay quantized (`place_quantized`: `QuantizedLinear`
layers over the file's blocks, a `QuantizedEmbedding` table, and a tied head over the
table's blocks) unless CORESTREAM_GGUF_DEQUANTIZE=1 asks for the float layers of old;
fused projections concatenate the parts' blocks where they share a type (a group of mixed
types keeps each part's blocks: `MixedQuantizedLinear`), and the experts of a layer keep
theirs, one quantized layer per expert and projection (`moe.QuantizedExperts`): a MoE
file's experts are most of its bytes. Quantized weights are not sharded: tensor
parallelism refuses them.
"""

from __future__ import annotations

import dataclasses
import importlib
import json
import logging
import os
import re
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from corestream_kernels import cpu_isa
from corestream_kernels.cpu_extension import cpu_ops
from corestream_kernels.cpu_linear import why_no_onednn
from corestream_kernels.quant import (
    WIDENS_TO_Q8_0,
    QuantizedWeight,
    dequantize,
    group_rows,
    quantize_int8_per_channel,
    widen_to_q8_0,
)
from safetensors import safe_open
from torch import nn

from services.common.gguf_checkpoint import GGUF_FILE_KEY
from services.common.pooling import Pooler, PoolingTask
from services.engine.models.checkpoint_layout import (
    SAFETENSORS_DTYPES,
    CheckpointLayout,
    Placement,
    TensorSpec,
)
from services.engine.models.decoder_config import DecoderConfig
from services.engine.models.gguf_weights import read_gguf
from services.engine.models.linear import (
    Linear,
    MixedQuantizedLinear,
    QuantizedEmbedding,
    QuantizedLinear,
    lay_out_for_cpu,
)
from services.engine.models.moe import (
    QuantizedExperts,
    SparseMoeBlock,
    SparseMoeForCausalLM,
    StackedExperts,
)
from services.engine.models.registry import MODEL_REGISTRY, supported, unsupported_message
from services.engine.models.tp_layers import split_evenly
from services.engine.models.tp_sharding import ShardPlan

if TYPE_CHECKING:
    from services.engine.models.llama import LlamaForCausalLM

logger = logging.getLogger(__name__)

Weight = torch.Tensor | QuantizedWeight | list[QuantizedWeight]
"""A checkpoint tensor as loading holds it: float, a file's blocks, or a fused group of
quantized parts of mixed types."""


@dataclasses.dataclass(frozen=True)
class QuantizedExpertWeights:
    """A stacked expert parameter (`w13`, `w2`) whose experts a GGUF file stores as
    blocks: each local expert's weight, its parts packed as `pack_projections` packs."""

    experts: list[QuantizedWeight | list[QuantizedWeight]]


_DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
}


def torch_dtype(name: str) -> torch.dtype:
    try:
        return _DTYPES[name.removeprefix("torch.")]
    except KeyError:
        raise ValueError(f"unsupported dtype {name!r}; expected one of {sorted(_DTYPES)}") from None


def model_class(architectures: list[str]) -> type[LlamaForCausalLM]:
    arch = supported(architectures)
    if arch is None:
        raise ValueError(unsupported_message(architectures))
    module_name, class_name = MODEL_REGISTRY[arch].split(":")
    return getattr(importlib.import_module(module_name), class_name)


def load_model(
    path: str | Path, dtype: torch.dtype, device: torch.device, max_model_len: int,
    quantization: str = "none", pooler: Pooler | None = None,
) -> LlamaForCausalLM:
    """The checkpoint's model in eval mode, with weights in `dtype` on `device`.

    `max_model_len` is the longest sequence it will see. `quantization` "int8" quantizes
    a safetensors checkpoint's linear weights as they load (`quantize_linear_weights`).
    With a `pooler` the model has no LM head (`lm_head` is None); a classifier gets its
    score head as `score`, unsharded on every rank.
    """
    folder = Path(path)
    hf_config = json.loads((folder / "config.json").read_text(encoding="utf-8"))
    cls = model_class(list(hf_config.get("architectures") or []))
    config = cls.config_from_hf(hf_config)
    if pooler is not None:
        config = dataclasses.replace(config, tie_word_embeddings=False)
    note_attention_window(config, max_model_len)
    with torch.device("meta"):
        model = cls(config)
        if pooler is not None:
            model.lm_head = None  # type: ignore[assignment]
            if pooler.task is PoolingTask.CLASSIFY:
                model.score = Linear(config.hidden_size, pooler.num_labels, bias=False)

    # The experts this rank holds; None for dense models.
    experts: range | None = getattr(model, "local_experts", None)
    renames: Mapping[str, str] = getattr(cls, "checkpoint_renames", {})
    # The tensor-parallel group the model was built for; None: read every tensor whole.
    tp = model.tp
    plan = ShardPlan(config, tp.rank, tp.world_size) if tp is not None else None
    def model_name(name: str) -> str | None:
        if pooler is not None:
            if name.startswith("lm_head."):
                return None  # a generative checkpoint served as an embedder
            if not name.startswith(("model.", "score.")):
                name = "model." + name  # a bare decoder's (sentence-transformers') names
        return _model_tensor_name(name, renames, experts)

    state: dict[str, Weight]
    # The way back from the model's parameters to the checkpoint's names, for live
    # weight updates (services/engine/weights).
    layout = CheckpointLayout(source="gguf" if hf_config.get(GGUF_FILE_KEY) else "safetensors")
    gguf_file = hf_config.get(GGUF_FILE_KEY)
    if quantization != "none" and (gguf_file or plan is not None):
        raise ValueError(
            f"quantization {quantization} takes a safetensors checkpoint on one rank; "
            + (f"{gguf_file} is a GGUF file, served with its own quantization" if gguf_file
               else "tensor parallelism does not shard quantized weights"))
    state = _read_state(folder, hf_config, dtype, device, model_name, plan, layout.tensors)
    if experts is not None:
        pack_experts(state, getattr(cls, "packed_experts", {}), experts, dtype,
                     layout.placements)
    # The fixed-logits stand-in has no projections, hence no packing to declare.
    pack_projections(state, getattr(cls, "packed_projections", {}), dtype, layout.placements)
    if quantization == "int8":  # after packing: a fused weight's rows keep their scales
        quantize_linear_weights(model, state)
    kinds = place_quantized(model, state, dtype)
    result = model.load_state_dict(state, strict=False, assign=True)
    missing = set(result.missing_keys)
    if config.tie_word_embeddings:
        missing.discard("lm_head.weight")
    if missing or result.unexpected_keys:
        raise ValueError(
            f"checkpoint {folder} does not fit {cls.__name__}: "
            f"missing {sorted(missing)}, unexpected {sorted(result.unexpected_keys)}"
        )
    embedding = getattr(getattr(model, "model", None), "embed_tokens", None)
    if pooler is not None:
        pass  # no LM head to tie or quantize
    elif config.tie_word_embeddings and isinstance(embedding, QuantizedEmbedding):
        # The head multiplies by the table's own blocks (SmolLM2: its biggest matrix).
        model.lm_head = QuantizedLinear(embedding.weight, None)
        kinds[f"tied head {embedding.weight.ggml_type.name}"] += 1
    elif config.tie_word_embeddings and quantization == "int8" and isinstance(
            embedding, nn.Embedding):
        # The table stays float for lookups; the head, every step's biggest matrix in
        # small models, multiplies by an int8 copy of it.
        model.lm_head = QuantizedLinear(
            for_kernels(quantize_int8_per_channel(embedding.weight)), None)
        kinds["tied head int8"] += 1
    else:
        model.tie_weights()
    model.checkpoint_layout = layout
    if kinds:
        logger.info("quantized layers (%s): %s",
                    "int8 per output channel, quantized at load" if quantization == "int8"
                    else "kept as the file's blocks",
                    ", ".join(f"{n} {kind}" for kind, n in kinds.most_common()))
    if device.type == "cpu":
        layouts = lay_out_for_cpu(model)
        why = why_no_onednn(dtype)
        logger.info("linear layers on this CPU (%s, %s): %s%s", cpu_isa.target().name,
                    str(dtype).removeprefix("torch."),
                    ", ".join(f"{n} {name}" for name, n in layouts.most_common()) or "none",
                    f" ({why})" if why else "")
    logger.info("loaded %s (%s) from %s onto %s as %s%s", cls.__name__,
                ", ".join(hf_config.get("architectures", [])), folder, device, dtype,
                f", tensor-parallel shard {tp.rank} of {tp.world_size}" if tp else "")
    return model.eval()


def _read_state(folder: Path, hf_config: dict[str, Any], dtype: torch.dtype,
                device: torch.device, model_name: Callable[[str], str | None],
                plan: ShardPlan | None, specs: dict[str, TensorSpec]) -> dict[str, Weight]:
    """The checkpoint's tensors that `model_name` keeps, from its GGUF file (quantized
    matrices kept as blocks) or its safetensors files (`specs` records those)."""
    gguf_file = hf_config.get(GGUF_FILE_KEY)
    if gguf_file:
        quantized = os.environ.get(DEQUANTIZE_ENV, "") in ("", "0")
        return dict(read_gguf(Path(gguf_file), hf_config["model_type"], dtype, device,
                              model_name, plan,
                              keep_quantized=lambda name: quantized and name.endswith(".weight")))
    return dict(_read_safetensors(folder, dtype, device, model_name, plan, specs))


def load_experts(model: SparseMoeForCausalLM, path: str | Path, dtype: torch.dtype,
                 device: torch.device) -> range:
    """Give `model` the experts its expert-parallel rank owns now, read from the
    checkpoint at `path`, in place of those it held; returns their ids.

    For a group re-formed without a rank (its ranks numbered afresh): every other weight,
    the KV cache and the requests stay as they are, and only the experts move. The
    checkpoint layout follows, so live weight updates reach the new experts."""
    folder = Path(path)
    hf_config = json.loads((folder / "config.json").read_text(encoding="utf-8"))
    cls = type(model)
    moe = model.config.moe
    assert moe is not None
    experts = model.expert_parallel.local_experts(moe.num_experts)
    renames: Mapping[str, str] = getattr(cls, "checkpoint_renames", {})

    def expert_name(name: str) -> str | None:
        ours = _model_tensor_name(name, renames, experts)
        return ours if ours is not None and _EXPERT_TENSOR.match(ours) else None

    # A tensor-parallel rank reads its slice of each expert, as the whole load does.
    tp = model.tp
    plan = ShardPlan(model.config, tp.rank, tp.world_size) if tp is not None else None
    specs: dict[str, TensorSpec] = {}
    state = _read_state(folder, hf_config, dtype, device, expert_name, plan, specs)
    layout: CheckpointLayout = model.checkpoint_layout
    layout.tensors.update({name: spec for name, spec in specs.items()
                           if _EXPERT_TENSOR.match(name)})
    for name in [n for n in layout.placements if (m := _EXPERT_TENSOR.match(n))
                 and int(m["id"]) not in experts]:
        del layout.placements[name]
    blocks = [(name, module) for name, module in model.named_modules()
              if isinstance(module, SparseMoeBlock)]
    with torch.device("meta"):
        for _, block in blocks:
            block.experts = StackedExperts(
                experts, model.config.hidden_size,
                split_evenly(moe.intermediate_size, tp.world_size if tp is not None else 1,
                             "the experts' intermediate_size"))
    pack_experts(state, getattr(cls, "packed_experts", {}), experts, dtype, layout.placements)
    place_quantized(model, state, dtype)
    result = model.load_state_dict(state, strict=False, assign=True)
    unloaded = [f"{name}.experts.{p}" for name, block in blocks
                for p, value in block.experts.named_parameters() if value.is_meta]
    if unloaded or result.unexpected_keys:
        raise ValueError(f"checkpoint {folder} does not hold experts {experts.start}.."
                         f"{experts.stop - 1} whole: missing {unloaded}, unexpected "
                         f"{sorted(result.unexpected_keys)}")
    model.local_experts = experts
    logger.info("experts %d..%d of %d loaded from %s", experts.start, experts.stop - 1,
                moe.num_experts, folder)
    return experts


def note_attention_window(config: DecoderConfig, max_model_len: int) -> None:
    """Log a sliding window that binds; every window is served as the checkpoint asks."""
    window = config.sliding_window
    if window is not None and window < max_model_len:
        # NOTE: the KV cache still keeps every block of a sequence, also those that slid
        # out of every window, so a window saves attention time but no cache memory.
        layers = "every layer" if config.sliding_layers is None else (
            f"layers {list(config.sliding_layers)}"
        )
        logger.info(
            "sliding attention window of %d tokens in %s (max_model_len %d)",
            window, layers, max_model_len,
        )


DEQUANTIZE_ENV = "CORESTREAM_GGUF_DEQUANTIZE"
"""Set to 1: a GGUF file's weights are dequantized at load into float layers (as before
the quantized layers; for comparisons)."""


def _linear_weight(name: str) -> bool:
    """Whether checkpoint tensor `name` is quantized by `--quantization int8`: a module's
    weight, not one expert's (a safetensors checkpoint's experts are stacked into one float
    tensor per layer)."""
    return name.endswith(".weight") and _EXPERT_TENSOR.match(name) is None


def quantize_linear_weights(model: nn.Module, state: dict[str, Weight]) -> None:
    """Replace, in `state`, the weight of every plain `Linear` of `model` by its int8
    quantization (`quantize_int8_per_channel`), each float tensor freed as its int8 one is
    made. Embedding tables, norms and experts stay float, and so does a weight whose rows
    are not whole blocks of 32 (logged)."""
    ragged = []
    for name in [n for n in state if _linear_weight(n)]:
        module = model.get_submodule(name.removesuffix(".weight"))
        tensor = state[name]
        if type(module) is Linear and isinstance(tensor, torch.Tensor):
            if tensor.shape[1] % 32:
                ragged.append(name)
                continue
            state[name] = quantize_int8_per_channel(tensor)
    if ragged:
        logger.info("int8: %d linear weights stay float (rows of %s values, not whole "
                    "blocks of 32), e.g. %s", len(ragged),
                    sorted({state[n].shape[1] for n in ragged}), ragged[0])


def place_quantized(model: nn.Module, state: dict[str, Weight], dtype: torch.dtype
                    ) -> Counter[str]:
    """Take every `QuantizedWeight` out of `state` into the module it belongs to: a plain
    `Linear` becomes a `QuantizedLinear` (its bias, if any, still loads from `state`), or
    a `MixedQuantizedLinear` for a fused group of parts of mixed types, an `nn.Embedding`
    a `QuantizedEmbedding` looking up into `dtype`; any other module gets the weight
    dequantized into `dtype`. Returns how many layers of which type."""
    kinds: Counter[str] = Counter()
    for name in [n for n, v in state.items() if isinstance(v, QuantizedExpertWeights)]:
        if name in state:  # (its partner may have placed it already)
            _place_quantized_experts(model, state, name.rpartition(".")[0], kinds)
    for name in [n for n, v in state.items() if not isinstance(v, torch.Tensor)]:
        weight = state.pop(name)
        assert isinstance(weight, QuantizedWeight | list)
        module_name = name.removesuffix(".weight")
        module = model.get_submodule(module_name)
        if type(module) is Linear:
            replacement, kind = _quantized_layer(weight, module.bias)
        elif isinstance(weight, list):
            state[name] = torch.cat([dequantize(w) for w in weight]).to(dtype)
            continue
        elif type(module) is nn.Embedding:
            # Grouped too: a tied head multiplies by the same blocks.
            replacement = QuantizedEmbedding(for_kernels(weight), dtype)
            kind = weight.ggml_type.name
        else:
            state[name] = dequantize(weight).to(dtype)
            continue
        parent, _, attr = module_name.rpartition(".")
        setattr(model.get_submodule(parent), attr, replacement)
        kinds[kind] += 1
    return kinds


def _quantized_layer(weight: QuantizedWeight | list[QuantizedWeight],
                     bias: torch.Tensor | None) -> tuple[nn.Module, str]:
    """The layer multiplying by `weight` (a fused group of mixed types: each part's own
    blocks), and its type's name."""
    if isinstance(weight, list):
        return (MixedQuantizedLinear([for_kernels(w) for w in weight], bias),
                "+".join(w.ggml_type.name for w in weight))
    return QuantizedLinear(for_kernels(weight), bias), weight.ggml_type.name


def _place_quantized_experts(model: nn.Module, state: dict[str, Weight | QuantizedExpertWeights],
                             module_name: str, kinds: Counter[str]) -> None:
    """Replace the `StackedExperts` `module_name` by `QuantizedExperts` over the blocks of
    its `w13` and `w2` in `state` (a float one, e.g. F16 in the file, becomes a float
    layer per expert)."""
    stacked: StackedExperts = model.get_submodule(module_name)
    per_projection: dict[str, list[nn.Module]] = {}
    for param in ("w13", "w2"):
        weight = state.pop(f"{module_name}.{param}")
        if isinstance(weight, QuantizedExpertWeights):
            layers = [_quantized_layer(w, None) for w in weight.experts]
            per_projection[param] = [layer for layer, _ in layers]
            kinds[f"experts {layers[0][1]}"] += len(layers)
        else:
            assert isinstance(weight, torch.Tensor)
            per_projection[param] = []
            for local, values in enumerate(weight):
                # Loaded with the rest: the layer's weight is taken from `state`.
                per_projection[param].append(
                    Linear(values.shape[1], values.shape[0], bias=False, device="meta"))
                state[f"{module_name}.{param}.{local}.weight"] = values
    parent, _, attr = module_name.rpartition(".")
    setattr(model.get_submodule(parent), attr,
            QuantizedExperts(stacked.first, per_projection["w13"], per_projection["w2"]))


def for_kernels(weight: QuantizedWeight) -> QuantizedWeight:
    """The weight in the layout the C++ kernels read fastest where they run: rows grouped
    by 16 for the decode GEMV (`group_rows`: a permutation of the same bytes, which the
    file's memory-mapped copy is then dropped for); as it is elsewhere."""
    return group_rows(weight) if cpu_ops(weight.blocks) is not None else weight


def pack_projections(
    state: dict[str, Weight], packed: Mapping[str, Sequence[str]],
    dtype: torch.dtype | None = None, placements: dict[str, Placement] | None = None,
) -> None:
    """Replace, in `state`, each complete group of `packed` parts by their concatenation.

    `packed` maps a fused module name to its parts in output order, e.g. qkv_proj to
    (q_proj, k_proj, v_proj): `*.q_proj.weight`, `*.k_proj.weight` and `*.v_proj.weight`
    become `*.qkv_proj.weight` (biases likewise). An incomplete group is left as it is,
    so that loading names the missing tensors.
    Quantized parts (`QuantizedWeight`, same columns) of one type concatenate their rows of
    blocks, which is exact; so do parts of Q4_0, Q5_0 and Q8_0 mixed, widened to Q8_0
    first (`widen_to_q8_0`, exact too); quantized parts of other mixed types stay a list of
    the parts (each keeps its blocks); parts mixed with float ones are dequantized into
    `dtype` first. `placements` records the rows each part took in the fused tensor.
    """
    for fused, parts in packed.items():
        marker = f".{parts[0]}."
        for name in [n for n in state if marker in n]:
            prefix, suffix = name.rsplit(marker, 1)
            names = [f"{prefix}.{part}.{suffix}" for part in parts]
            if all(n in state for n in names):
                fused_name = f"{prefix}.{fused}.{suffix}"
                if placements is not None:
                    _place_rows(placements, fused_name, names,
                                [_num_rows(state[n]) for n in names])
                # pop, so that each part is freed as soon as its group is packed.
                state[fused_name] = _concat([state.pop(n) for n in names], dtype)


def _num_rows(weight: Weight) -> int:
    if isinstance(weight, torch.Tensor):
        return weight.shape[0]
    if isinstance(weight, QuantizedWeight):
        return weight.out_features
    return sum(w.out_features for w in weight)


def _place_rows(placements: dict[str, Placement], param: str, names: Sequence[str],
                rows: Sequence[int], *leading: int) -> None:
    start = 0
    for name, n in zip(names, rows, strict=True):
        placements[name] = Placement(param, (*leading, slice(start, start + n)))
        start += n


def _concat(parts: list[Weight], dtype: torch.dtype | None) -> Weight:
    """The rows of `parts` in order (see `pack_projections`)."""
    weights = [p for p in parts if isinstance(p, QuantizedWeight)]
    if len(weights) == len(parts):  # (a part is never a list: groups do not nest)
        if len({w.ggml_type for w in weights}) > 1 and all(
                w.ggml_type in WIDENS_TO_Q8_0 for w in weights):
            # Exactly, one type: the one-call decode op takes a fused weight of one type.
            weights = [widen_to_q8_0(w) for w in weights]
        if len({w.ggml_type for w in weights}) == 1:
            return QuantizedWeight(torch.cat([w.blocks for w in weights]),
                                   weights[0].ggml_type, weights[0].in_features,
                                   sum(w.out_features for w in weights))
        return weights  # each part keeps its type (`MixedQuantizedLinear`)
    tensors = [dequantize(p).to(dtype or torch.float32) if isinstance(p, QuantizedWeight)
               else p for p in parts]
    return torch.cat(tensors)


# A checkpoint tensor of one expert: `<prefix>.experts.<id>.<projection>.weight`.
_EXPERT_TENSOR = re.compile(r"^(?P<prefix>.+)\.experts\.(?P<id>\d+)\.(?P<part>[^.]+)\.weight$")


def _model_tensor_name(
    name: str, renames: Mapping[str, str], experts: range | None
) -> str | None:
    """The model's name for checkpoint tensor `name`; None to skip it."""
    for old, new in renames.items():
        name = name.replace(f".{old}.", f".{new}.")
    if experts is not None:
        match = _EXPERT_TENSOR.match(name)
        if match and int(match["id"]) not in experts:
            return None
    return name


def pack_experts(
    state: dict[str, Weight | QuantizedExpertWeights], packed: Mapping[str, Sequence[str]],
    experts: range, dtype: torch.dtype | None = None,
    placements: dict[str, Placement] | None = None,
) -> None:
    """Replace, in `state`, each MoE layer's per-expert tensors by stacked ones.

    `packed` maps a stacked parameter to the per-expert projections it concatenates,
    e.g. w13 to (gate_proj, up_proj): `*.experts.<e>.gate_proj.weight` and
    `*.experts.<e>.up_proj.weight` of every e in `experts` become `*.experts.w13`
    `[len(experts), 2I, H]`. An incomplete layer is left as it is, so that loading
    names the missing tensors. `placements` records each part's expert and rows.
    Quantized experts (a GGUF file's) are packed per expert as `pack_projections` packs a
    fused group, into `QuantizedExpertWeights`; parts mixed with float ones are
    dequantized into `dtype`.
    """
    prefixes = {m["prefix"] for name in state if (m := _EXPERT_TENSOR.match(name))}
    for prefix in sorted(prefixes):
        for stacked, parts in packed.items():
            names = [[f"{prefix}.experts.{e}.{part}.weight" for part in parts] for e in experts]
            if all(n in state for row in names for n in row):
                if placements is not None:
                    for local, row in enumerate(names):
                        _place_rows(placements, f"{prefix}.experts.{stacked}", row,
                                    [_num_rows(state[n]) for n in row], local)
                fused = [_concat([state.pop(n) for n in row], dtype) for row in names]
                floats = [f for f in fused if isinstance(f, torch.Tensor)]
                state[f"{prefix}.experts.{stacked}"] = (
                    torch.stack(floats) if len(floats) == len(fused)
                    else QuantizedExpertWeights([f for f in fused
                                                 if not isinstance(f, torch.Tensor)]))


def _read_safetensors(
    folder: Path,
    dtype: torch.dtype,
    device: torch.device,
    model_name: Callable[[str], str | None] = lambda name: name,
    plan: ShardPlan | None = None,
    specs: dict[str, TensorSpec] | None = None,
) -> dict[str, torch.Tensor]:
    """The checkpoint's tensors by the model's names (this rank's shards), in `dtype` on
    `device`; `specs` records every tensor's full shape and stored dtype."""
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors files in {folder}")
    state: dict[str, torch.Tensor] = {}
    for file in files:
        with safe_open(str(file), framework="pt", device="cpu") as f:
            for name in f.keys():  # noqa: SIM118 (safe_open is not a mapping)
                # Precomputed RoPE tables in old checkpoints; ours are derived from config.
                if name.endswith("rotary_emb.inv_freq"):
                    continue
                ours = model_name(name)
                part = f.get_slice(name)
                shape = tuple(part.get_shape())
                if specs is not None:
                    specs[name] = TensorSpec(shape, SAFETENSORS_DTYPES[part.get_dtype()], ours)
                if ours is None:
                    continue
                tensor = f.get_tensor(name) if plan is None else plan.read(ours, part, shape)
                if tensor.is_floating_point():
                    tensor = tensor.to(dtype)
                state[ours] = tensor.to(device)
    return state
