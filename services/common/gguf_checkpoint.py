"""A GGUF file as a checkpoint: a folder *view* of its metadata, written once into the cache.

llama.cpp's GGUF holds in one file what a Hugging Face checkpoint spreads over several:
the model's hyperparameters, the tokenizer (vocabulary, merges, special ids), the chat
template and the (usually quantized) weights. `ensure_gguf_view` turns the metadata into
the files every service already reads (config.json, generation_config.json,
tokenizer.json, tokenizer_config.json, chat_template.jinja), so the frontend, the model
info and the chat templates work unchanged; no weight is copied: config.json names the
file (`GGUF_FILE_KEY`) and the engine reads the tensors from it
(services/engine/models/gguf_weights.py).

The view lives under `<cache>/gguf/<stem>-<key>`, where the key hashes the file's absolute
path, size and modification time with `VIEW_VERSION`: a changed or moved file, or a new
writer, gets a new view. It is written like the tiny checkpoint (into a temporary folder,
then renamed; the first rename wins). Torch-free, because the frontend calls it too; it
reads the file with the `gguf` package (memory-mapped; metadata and tensor names only).
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

from services.common.cache_folder import ensure_folder
from services.common.gguf_tokenizer import build_tokenizer, tokenizer_config

if TYPE_CHECKING:
    from gguf import GGUFReader

GGUF_SUFFIX = ".gguf"
GGUF_FILE_KEY = "corestream_gguf_file"
"""config.json key naming the GGUF file whose tensors are the checkpoint's weights."""
ROPE_FREQS = "rope_freqs.weight"
"""The tensor of per-pair RoPE frequency divisors (Llama 3.1 scaling) a GGUF may hold."""
# Bump whenever the files written below change, so that stale views are ignored.
VIEW_VERSION = "gguf-view-v1"

# general.architecture -> (our architecture, model_type); llama with experts is Mixtral.
# Mistral's dense models are converted as "llama" and served as Llama.
_ARCHITECTURES: dict[str, tuple[str, str]] = {
    "llama": ("LlamaForCausalLM", "llama"),
    "qwen2": ("Qwen2ForCausalLM", "qwen2"),
    "qwen3": ("Qwen3ForCausalLM", "qwen3"),
    "qwen2moe": ("Qwen2MoeForCausalLM", "qwen2_moe"),
    "qwen3moe": ("Qwen3MoeForCausalLM", "qwen3_moe"),
}
_MIXTRAL = ("MixtralForCausalLM", "mixtral")

# `<arch>.<key>` -> config.json key, for every architecture above.
_HPARAMS: dict[str, str] = {
    "block_count": "num_hidden_layers",
    "embedding_length": "hidden_size",
    "feed_forward_length": "intermediate_size",
    "attention.head_count": "num_attention_heads",
    "attention.head_count_kv": "num_key_value_heads",
    "attention.key_length": "head_dim",
    "attention.layer_norm_rms_epsilon": "rms_norm_eps",
    "rope.freq_base": "rope_theta",
    "context_length": "max_position_embeddings",
    "attention.sliding_window": "sliding_window",
}
# The same for the experts; the names differ per family.
_MOE_HPARAMS: dict[str, dict[str, str]] = {
    "mixtral": {"expert_count": "num_local_experts", "expert_used_count": "num_experts_per_tok"},
    "qwen2_moe": {
        "expert_count": "num_experts",
        "expert_used_count": "num_experts_per_tok",
        "expert_feed_forward_length": "moe_intermediate_size",
        "expert_shared_feed_forward_length": "shared_expert_intermediate_size",
    },
    "qwen3_moe": {
        "expert_count": "num_experts",
        "expert_used_count": "num_experts_per_tok",
        "expert_feed_forward_length": "moe_intermediate_size",
    },
}
# llama.cpp's Qwen3-MoE renormalizes the top-k routing weights; the GGUF does not say so.
_MOE_DEFAULTS: dict[str, dict[str, Any]] = {"qwen3_moe": {"norm_topk_prob": True}}


def gguf_file_of(path: Path) -> Path | None:
    """The GGUF file a `--model` path names: the file itself, or the only .gguf of a
    folder that is no Hugging Face checkpoint (no config.json); None otherwise."""
    if path.is_file() and path.suffix == GGUF_SUFFIX:
        return path
    if path.is_dir() and not (path / "config.json").is_file():
        found = sorted(path.glob(f"*{GGUF_SUFFIX}"))
        if len(found) == 1:
            return found[0]
        if len(found) > 1:
            names = ", ".join(f.name for f in found)
            raise ValueError(f"{path} holds several GGUF files ({names}); pass --model "
                             "with the one to serve")
    return None


def view_dir(file: Path, cache_dir: Path) -> Path:
    """Where the view of `file` lives: keyed by its absolute path, size and mtime."""
    file = file.resolve()
    stat = file.stat()
    key = f"{VIEW_VERSION}\0{file}\0{stat.st_size}\0{stat.st_mtime_ns}"
    digest = hashlib.sha256(key.encode()).hexdigest()[:16]
    return cache_dir / "gguf" / f"{file.stem}-{digest}"


def ensure_gguf_view(file: Path, cache_dir: Path) -> Path:
    """The view folder of GGUF `file`, writing it first if it does not exist yet."""
    return ensure_folder(view_dir(file, cache_dir),
                         lambda folder: write_gguf_view(file.resolve(), folder))


def write_gguf_view(file: Path, folder: Path) -> None:
    """Write the view's files of GGUF `file` into the existing, empty `folder`."""
    # Imported here: every service resolves --model, few of them ever see a GGUF.
    from gguf import GGUFReader

    reader = GGUFReader(file)
    metadata = read_metadata(reader)
    tensor_names = {t.name for t in reader.tensors}
    config = model_config(metadata, tensor_names, file, rope_factors(reader))
    tokenizer = build_tokenizer(metadata)
    tokenizer.save(str(folder / "tokenizer.json"))
    _write_json(folder / "tokenizer_config.json",
                tokenizer_config(metadata, config["max_position_embeddings"]))
    _write_json(folder / "config.json", config)
    generation = {k: config[k] for k in ("bos_token_id", "eos_token_id") if k in config}
    _write_json(folder / "generation_config.json", generation)
    if template := metadata.get("tokenizer.chat_template"):
        (folder / "chat_template.jinja").write_text(template, encoding="utf-8")


def read_metadata(reader: GGUFReader) -> dict[str, Any]:
    """Every key-value field of a GGUF file, as Python values (arrays as lists)."""
    return {name: field.contents() for name, field in reader.fields.items()
            if not name.startswith("GGUF.")}


def rope_factors(reader: GGUFReader) -> list[float] | None:
    """The values of the file's `rope_freqs` tensor, if it has one: llama.cpp's converter
    stores Llama 3.1's rope scaling as these per-pair divisors, not as metadata."""
    from gguf.quants import dequantize

    for tensor in reader.tensors:
        if tensor.name == ROPE_FREQS:
            return [float(v) for v in dequantize(tensor.data, tensor.tensor_type).reshape(-1)]
    return None


def model_config(metadata: dict[str, Any], tensor_names: set[str], file: Path,
                 rope_factors: list[float] | None = None) -> dict[str, Any]:
    """config.json for the model GGUF `metadata` describes (`tensor_names`: its tensors;
    `rope_factors`: its `rope_freqs` values)."""
    arch = str(metadata.get("general.architecture"))
    if arch not in _ARCHITECTURES:
        raise ValueError(f"GGUF architecture {arch!r} of {file} is not served; supported: "
                         f"{sorted(_ARCHITECTURES)}")
    if (ROPE_FREQS in tensor_names) != (rope_factors is not None):
        raise ValueError(f"{file}: the values of its {ROPE_FREQS} tensor are needed")
    experts = int(metadata.get(f"{arch}.expert_count") or 0)
    architecture, model_type = _MIXTRAL if arch == "llama" and experts else _ARCHITECTURES[arch]
    hparams = {**_HPARAMS, **_MOE_HPARAMS.get(model_type, {})}
    config: dict[str, Any] = {
        "architectures": [architecture],
        "model_type": model_type,
        "hidden_act": "silu",
        **_MOE_DEFAULTS.get(model_type, {}),
    }
    for key, name in hparams.items():
        if (value := metadata.get(f"{arch}.{key}")) is not None:
            config[name] = value
    config.setdefault("num_key_value_heads", config["num_attention_heads"])
    config.setdefault("head_dim", config["hidden_size"] // config["num_attention_heads"])
    config["vocab_size"] = int(metadata.get(f"{arch}.vocab_size")
                               or len(metadata["tokenizer.ggml.tokens"]))
    if rope_scaling := _rope_scaling(metadata, arch):
        config["rope_scaling"] = rope_scaling
    if rope_factors is not None:
        if rope_scaling:
            raise ValueError(f"{file} scales RoPE twice: {rope_scaling['rope_type']} in its "
                             f"metadata and a {ROPE_FREQS} tensor")
        config["rope_scaling"] = {"rope_type": "frequency_factors", "factors": rope_factors}
    config["tie_word_embeddings"] = "output.weight" not in tensor_names
    if arch == "qwen2moe" and not any(".attn_q.bias" in name for name in tensor_names):
        config["qkv_bias"] = False
    for ours, key in (("bos_token_id", "bos_token_id"), ("eos_token_id", "eos_token_id"),
                      ("pad_token_id", "padding_token_id")):
        if (value := metadata.get(f"tokenizer.ggml.{key}")) is not None:
            config[ours] = int(value)
    # Every GGUF tensor type dequantizes exactly to float32 (blocks scale by float16).
    config["torch_dtype"] = "float32"
    config[GGUF_FILE_KEY] = str(file)
    return config


def _rope_scaling(metadata: dict[str, Any], arch: str) -> dict[str, Any] | None:
    """The rope scaling GGUF metadata states (linear or YaRN), as config.json spells it."""
    kind = metadata.get(f"{arch}.rope.scaling.type")
    if kind in (None, "none"):
        return None
    scaling: dict[str, Any] = {"rope_type": kind,
                               "factor": float(metadata[f"{arch}.rope.scaling.factor"])}
    if (original := metadata.get(f"{arch}.rope.scaling.original_context_length")) is not None:
        scaling["original_max_position_embeddings"] = int(original)
    return scaling


def _write_json(path: Path, data: dict[str, Any]) -> None:
    path.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n", encoding="utf-8")
