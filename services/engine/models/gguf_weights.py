"""The weights of a GGUF file, under the Hugging Face names our models load.

A GGUF view (services/common/gguf_checkpoint.py) names its file in config.json; the
loader reads the tensors from there instead of from safetensors shards. `gguf_tensors`
names each tensor as a Hugging Face checkpoint would (`blk.3.attn_q.weight` is
`model.layers.3.self_attn.q_proj.weight`; a stacked expert tensor `blk.3.ffn_up_exps` is
one `...mlp.experts.<e>.up_proj.weight` per expert) and undoes what llama.cpp's converter
did to the layout: for the llama architecture it interleaved the two halves of every q
and k head's rows (its RoPE rotates adjacent pairs, ours rotates halves). Rows are whole
quantization blocks, so that permutation runs on the raw blocks.

A linear weight of a block type (`QUANTIZED_TYPES`) stays as the file stores it:
`read_gguf` hands it over as a `QuantizedWeight` over the file's bytes (memory-mapped, or
the permuted copy), which `linear.QuantizedLinear` multiplies by as it is; every other
tensor (norms, F32/F16 ones, stacked experts) is dequantized into the serving dtype.
"""

from __future__ import annotations

import dataclasses
import re
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from corestream_kernels.quant import GGMLType, QuantizedWeight
from gguf import GGMLQuantizationType, GGUFReader, ReaderTensor
from gguf.quants import dequantize

from services.engine.models.tp_sharding import ShardPlan

QUANTIZED_TYPES = frozenset(GGMLType[name] for name in (
    "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q4_K", "Q5_K", "Q6_K"))
"""The block types a linear layer serves as stored (`corestream_kernels.quant.quant_linear`)."""

# blk.<i>.<part> -> the layer's module, as Hugging Face names it.
_LAYER_PARTS: dict[str, str] = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "ffn_gate_inp": "mlp.gate",
    "ffn_gate_shexp": "mlp.shared_expert.gate_proj",
    "ffn_up_shexp": "mlp.shared_expert.up_proj",
    "ffn_down_shexp": "mlp.shared_expert.down_proj",
    "ffn_gate_inp_shexp": "mlp.shared_expert_gate",
}
# blk.<i>.<part> holding every expert ([experts, rows, cols]) -> each expert's projection.
_EXPERT_PARTS: dict[str, str] = {
    "ffn_gate_exps": "gate_proj", "ffn_up_exps": "up_proj", "ffn_down_exps": "down_proj",
}
# Mixtral's checkpoints call the experts' projections w1 (gate), w3 (up) and w2 (down).
_MIXTRAL_EXPERT_PARTS = {"gate_proj": "w1", "up_proj": "w3", "down_proj": "w2"}
_TOP_LEVEL: dict[str, str] = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}
# blk.<i>.<part>[.<expert>].<weight|bias>; the expert index is older files' Mixtral format.
_LAYER_TENSOR = re.compile(r"^blk\.(?P<layer>\d+)\.(?P<part>[a-z_]+)(?:\.(?P<expert>\d+))?"
                           r"\.(?P<kind>weight|bias)$")


@dataclass(frozen=True)
class GGUFTensor:
    """One tensor as the file stores it (quantized blocks), in Hugging Face row order."""

    qtype: GGMLQuantizationType
    blocks: np.ndarray
    """The raw data, memory-mapped where no permutation copied it: `[rows, bytes per
    row]` for block types, the values themselves for F32/F16/BF16."""
    shape: tuple[int, ...]
    """The dequantized shape as torch orders it (`[out, in]` for a linear weight)."""

    def dequantize(self) -> np.ndarray:
        """float32 values of `shape` in an array of their own: F32 tensors come back as a
        view of the file's read-only memory map, so those are copied."""
        values = dequantize(self.blocks, self.qtype).reshape(self.shape)
        return values if values.flags.writeable else values.copy()

    @property
    def is_quantized_matrix(self) -> bool:
        """A 2-D weight of a block type: a linear layer can take it as it is stored."""
        return len(self.shape) == 2 and int(self.qtype) in QUANTIZED_TYPES

    def quantized_weight(self) -> QuantizedWeight:
        """The blocks as a `QuantizedWeight`, over the file's bytes (no copy): a memory-map
        is read-only, which torch warns about, but nothing writes to weights."""
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*not writable.*")
            data = torch.from_numpy(self.blocks)
        return QuantizedWeight.from_file(data, int(self.qtype), self.shape)


def gguf_tensors(reader: GGUFReader, model_type: str) -> Iterator[tuple[str, GGUFTensor]]:
    """Every tensor of the file under its Hugging Face name (`model_type` from
    config.json picks the expert names), with llama.cpp's q/k permutation undone."""
    arch = reader.fields["general.architecture"].contents()
    heads = {
        "attn_q": int(reader.fields[f"{arch}.attention.head_count"].contents()),
        "attn_k": int((reader.fields.get(f"{arch}.attention.head_count_kv")
                       or reader.fields[f"{arch}.attention.head_count"]).contents()),
    }
    for tensor in reader.tensors:
        shape = tuple(int(n) for n in reversed(tensor.shape))
        if tensor.name == "rope_freqs.weight":
            continue
        if tensor.name.rsplit(".", 1)[0] in _TOP_LEVEL:
            base, kind = tensor.name.rsplit(".", 1)
            yield f"{_TOP_LEVEL[base]}.{kind}", GGUFTensor(tensor.tensor_type, tensor.data, shape)
            continue
        match = _LAYER_TENSOR.match(tensor.name)
        if match is None:
            raise ValueError(f"GGUF tensor {tensor.name!r} has no place in the model")
        yield from _layer_tensors(tensor, match, shape, model_type,
                                  heads if arch == "llama" else {})


def _layer_tensors(
    tensor: ReaderTensor, match: re.Match[str], shape: tuple[int, ...], model_type: str,
    permuted_heads: dict[str, int],
) -> Iterator[tuple[str, GGUFTensor]]:
    layer, part, kind = match["layer"], match["part"], match["kind"]
    prefix = f"model.layers.{layer}."
    if part in _EXPERT_PARTS or match["expert"] is not None:
        # Stacked ([experts, rows, cols]), or one expert of an old Mixtral file.
        projection = _EXPERT_PARTS.get(part) or _LAYER_PARTS[part].removeprefix("mlp.")
        if model_type == "mixtral":
            projection = _MIXTRAL_EXPERT_PARTS[projection]
        if match["expert"] is not None:
            name = f"{prefix}mlp.experts.{match['expert']}.{projection}.{kind}"
            yield name, GGUFTensor(tensor.tensor_type, tensor.data, shape)
            return
        for expert in range(shape[0]):
            name = f"{prefix}mlp.experts.{expert}.{projection}.{kind}"
            yield name, GGUFTensor(tensor.tensor_type, tensor.data[expert], shape[1:])
        return
    if part not in _LAYER_PARTS:
        raise ValueError(f"GGUF tensor {tensor.name!r} has no place in the model")
    blocks = tensor.data
    if part in permuted_heads:
        blocks = _unpermute_rows(blocks, permuted_heads[part])
    if part == "ffn_gate_inp_shexp":
        # Stored as a vector; the model's shared-expert gate is a [1, hidden] linear.
        shape = (1, *shape)
    yield f"{prefix}{_LAYER_PARTS[part]}.{kind}", GGUFTensor(tensor.tensor_type, blocks, shape)


def _unpermute_rows(rows: np.ndarray, num_heads: int) -> np.ndarray:
    """Undo llama.cpp's `permute` of a q or k projection (weight or bias): within each
    head, its rows were reordered from [half 0; half 1] to pairs (r, r + half)."""
    half = rows.shape[0] // num_heads // 2
    # [heads, half, 2, ...] -> [heads, 2, half, ...]
    pairs = rows.reshape(num_heads, half, 2, *rows.shape[1:])
    return np.ascontiguousarray(pairs.swapaxes(1, 2)).reshape(rows.shape)


def read_gguf(
    file: Path,
    model_type: str,
    dtype: torch.dtype,
    device: torch.device,
    model_name: Callable[[str], str | None] = lambda name: name,
    plan: ShardPlan | None = None,
    keep_quantized: Callable[[str], bool] = lambda name: False,
) -> dict[str, torch.Tensor | QuantizedWeight]:
    """The model's tensors from GGUF `file`; as `loader._read_safetensors`, `model_name`
    renames or skips (None) each, and `plan` keeps this tensor-parallel rank's slice.
    A 2-D tensor of a block type whose (model's) name `keep_quantized` accepts comes as a
    `QuantizedWeight` on `device`; the others are dequantized into `dtype`."""
    reader = GGUFReader(file)
    state: dict[str, torch.Tensor | QuantizedWeight] = {}
    for name, tensor in gguf_tensors(reader, model_type):
        ours = model_name(name)
        if ours is None:
            continue
        if tensor.is_quantized_matrix and keep_quantized(ours):
            if plan is not None:
                raise ValueError("tensor parallelism over a GGUF file's quantized weights "
                                 "is not supported yet: serve it with "
                                 "--tensor-parallel-size 1")
            weight = tensor.quantized_weight()
            if device.type != "cpu":
                weight = dataclasses.replace(weight, blocks=weight.blocks.to(device))
            state[ours] = weight
            continue
        values = torch.from_numpy(tensor.dequantize())
        if plan is not None:
            values = plan.read(ours, values, tuple(values.shape))
        state[ours] = values.to(dtype).to(device)
    return state
