"""A Hugging Face model written as a GGUF file, laid out as llama.cpp's converter lays it.

Only one real GGUF ships with the tests (SmolLM2: Llama, dense). The other families the
GGUF reader serves (Qwen2, Qwen3, Mistral, Mixtral, Qwen2-MoE, Qwen3-MoE, Llama 3.1's
`rope_freqs`) are checked on tiny random models written here. So that this writer and
our reader cannot agree on a mistake between themselves, tensor names come from the
`gguf` package's own name map (the table llama.cpp's converter uses), and the tests read
each file back with transformers' GGUF loader as well.

What the converter does and this writer does too: the llama architecture (Llama, Mistral,
Mixtral) stores q and k rows permuted per head (its RoPE rotates adjacent pairs); experts
are stacked into one `[experts, rows, cols]` tensor per projection; Qwen2-MoE's shared
expert gate is a vector; Llama 3.1's rope scaling becomes a `rope_freqs` tensor of
per-pair divisors. Linear weights (and the embedding table) are stored as `qtype` where
their rows are whole blocks; norms and biases stay F32.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import torch
from gguf import MODEL_ARCH, MODEL_ARCH_NAMES, GGMLQuantizationType

# model_type -> the architecture llama.cpp's converter writes it as.
ARCHITECTURES: dict[str, MODEL_ARCH] = {
    "llama": MODEL_ARCH.LLAMA,
    "mistral": MODEL_ARCH.LLAMA,
    "mixtral": MODEL_ARCH.LLAMA,
    "qwen2": MODEL_ARCH.QWEN2,
    "qwen3": MODEL_ARCH.QWEN3,
    "qwen2_moe": MODEL_ARCH.QWEN2MOE,
    "qwen3_moe": MODEL_ARCH.QWEN3MOE,
}
# GPT-2's byte-to-character table: the 256 printable stand-ins of a byte-level vocabulary.
_PRINTABLE = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1),
              *range(ord("®"), ord("ÿ") + 1)]


def byte_vocabulary(size: int) -> dict[str, Any]:
    """Tokenizer metadata of a byte-level BPE with one token per byte and no merges,
    padded with control tokens to `size` (the random models' vocabulary)."""
    unprintable = [b for b in range(256) if b not in _PRINTABLE]
    chars = {b: chr(b) for b in _PRINTABLE} | {b: chr(256 + i) for i, b in enumerate(unprintable)}
    tokens = [chars[b] for b in range(256)] + [f"<|extra_{i}|>" for i in range(size - 256)]
    return {
        "model": "gpt2",
        "pre": "qwen2",
        "tokens": tokens[:size],
        "token_types": [1] * min(size, 256) + [3] * (size - 256),
        "merges": [],
        "bos": 1,
        "eos": 2,
    }


def write_gguf(model: Any, path: Path,
               qtype: GGMLQuantizationType = GGMLQuantizationType.F32) -> Path:
    """Write transformers `model` (a *ForCausalLM) as the GGUF file `path`."""
    config = model.config
    arch = ARCHITECTURES[config.model_type]
    writer = gguf.GGUFWriter(path, MODEL_ARCH_NAMES[arch])
    _write_hparams(writer, config)
    _write_tokenizer(writer, byte_vocabulary(config.vocab_size))
    names = gguf.get_tensor_name_map(arch, config.num_hidden_layers)
    for name, tensor in _converter_tensors(model, arch):
        base, _, kind = name.rpartition(".")
        gguf_name = "rope_freqs" if base == "rope_freqs" else names.get_name(base)
        assert gguf_name is not None, f"no GGUF name for {name}"
        data, stored_type = _stored(tensor, qtype)
        writer.add_tensor(f"{gguf_name}.{kind}", data, raw_dtype=stored_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def _write_hparams(writer: gguf.GGUFWriter, config: Any) -> None:
    writer.add_block_count(config.num_hidden_layers)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    writer.add_rope_dimension_count(head_dim)
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_rope_freq_base(_rope(config)["rope_theta"])
    writer.add_vocab_size(config.vocab_size)
    experts = getattr(config, "num_local_experts", None) or getattr(config, "num_experts", None)
    if experts:
        writer.add_expert_count(experts)
        writer.add_expert_used_count(config.num_experts_per_tok)
    if moe_size := getattr(config, "moe_intermediate_size", None):
        writer.add_expert_feed_forward_length(moe_size)
    if shared := getattr(config, "shared_expert_intermediate_size", None):
        writer.add_expert_shared_feed_forward_length(shared)


def _write_tokenizer(writer: gguf.GGUFWriter, vocabulary: dict[str, Any]) -> None:
    writer.add_tokenizer_model(vocabulary["model"])
    writer.add_tokenizer_pre(vocabulary["pre"])
    writer.add_token_list(vocabulary["tokens"])
    writer.add_token_types(vocabulary["token_types"])
    writer.add_token_merges(vocabulary["merges"])
    writer.add_bos_token_id(vocabulary["bos"])
    writer.add_eos_token_id(vocabulary["eos"])


def _rope(config: Any) -> dict[str, Any]:
    """The config's rope settings (transformers 5 keeps them in `rope_parameters`)."""
    parameters = dict(getattr(config, "rope_parameters", None) or {})
    parameters.setdefault("rope_theta", getattr(config, "rope_theta", 10000.0))
    return parameters


def _converter_tensors(model: Any, arch: MODEL_ARCH) -> list[tuple[str, torch.Tensor]]:
    """The model's tensors under the names and in the layouts the converter writes."""
    config = model.config
    heads = {"q_proj": config.num_attention_heads, "k_proj": config.num_key_value_heads}
    out: list[tuple[str, torch.Tensor]] = []
    for name, tensor in model.state_dict().items():
        tensor = tensor.detach().float()
        if name.endswith("mlp.experts.gate_up_proj"):
            # transformers fuses each expert's gate and up rows; ggml stacks them apart.
            gate, up = tensor.chunk(2, dim=1)
            out += [(name.replace("gate_up_proj", "gate_proj.weight"), gate),
                    (name.replace("gate_up_proj", "up_proj.weight"), up)]
            continue
        if name.endswith("mlp.experts.down_proj"):
            out.append((f"{name}.weight", tensor))
            continue
        tensor = _as_stored(name, tensor)
        projection = name.split(".")[-2]
        if arch == MODEL_ARCH.LLAMA and projection in heads:
            tensor = _permute(tensor, heads[projection])
        out.append((name, tensor))
    if (factors := _rope_factors(config)) is not None:
        out.append(("rope_freqs.weight", factors))
    return out


def _as_stored(name: str, tensor: torch.Tensor) -> torch.Tensor:
    """Qwen2-MoE's shared expert gate, a `[1, hidden]` linear, is stored as a vector."""
    return tensor.reshape(-1) if name.endswith("shared_expert_gate.weight") else tensor


def rounded_weights(model: Any, qtype: GGMLQuantizationType) -> dict[str, torch.Tensor]:
    """`model`'s weights as a `qtype` file written from it holds them: every tensor the
    writer stores as blocks rounded through gguf's own quantize and dequantize (the
    converter's permutations and splits move whole rows, so they change no value)."""
    rounded = {}
    for name, tensor in model.state_dict().items():
        data, stored_type = _stored(_as_stored(name, tensor.detach().float()), qtype)
        if stored_type is not None:
            values = gguf.quants.dequantize(data, stored_type)
            tensor = torch.from_numpy(values).reshape(tensor.shape)
        rounded[name] = tensor
    return rounded


def _permute(rows: torch.Tensor, num_heads: int) -> torch.Tensor:
    """llama.cpp's `permute`: each head's rows from [half 0; half 1] to pairs (r, r+half)."""
    shape = rows.shape
    return rows.reshape(num_heads, 2, shape[0] // num_heads // 2, *shape[1:]).swapaxes(1, 2) \
        .reshape(shape)


def _rope_factors(config: Any) -> torch.Tensor | None:
    """Llama 3.1's rope scaling as the converter stores it: one divisor per frequency pair
    (1 for short wavelengths, `factor` for long ones, a blend between)."""
    rope = _rope(config)
    if rope.get("rope_type") != "llama3":
        return None
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    frequencies = 1.0 / rope["rope_theta"] ** (torch.arange(0, head_dim, 2).float() / head_dim)
    factor, low, high = rope["factor"], rope["low_freq_factor"], rope["high_freq_factor"]
    original = rope["original_max_position_embeddings"]
    factors = []
    for frequency in frequencies.tolist():
        wavelength = 2 * math.pi / frequency
        if wavelength < original / high:
            factors.append(1.0)
        elif wavelength > original / low:
            factors.append(factor)
        else:
            smooth = (original / wavelength - low) / (high - low)
            factors.append(1 / ((1 - smooth) / factor + smooth))
    return torch.tensor(factors, dtype=torch.float32)


def _stored(
    tensor: torch.Tensor, qtype: GGMLQuantizationType
) -> tuple[np.ndarray, GGMLQuantizationType | None]:
    """F32 values, or `qtype` blocks for a matrix whose rows are whole blocks (the writer
    takes the shape of uint8 blocks from their byte shape)."""
    values = tensor.numpy()
    block = gguf.GGML_QUANT_SIZES[qtype][0]
    if qtype == GGMLQuantizationType.F32 or values.ndim < 2 or values.shape[-1] % block:
        return values, None
    return gguf.quants.quantize(values, qtype), qtype
