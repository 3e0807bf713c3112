"""What every service needs to know about a checkpoint, read without torch.

The frontend uses it for limits and EOS handling, the engine for sizing its KV
cache; both read the same Hugging Face `config.json` (plus `generation_config.json`,
whose EOS ids take precedence because chat models often list several there).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from services.common.gguf_checkpoint import GGUF_FILE_KEY

# Keys under which Hugging Face configs spell the context length, most specific first.
_CONTEXT_LENGTH_KEYS = (
    "max_position_embeddings",
    "max_sequence_length",
    "seq_length",
    "n_positions",
)


@dataclass(frozen=True, slots=True)
class ModelInfo:
    name: str
    path: str
    architectures: tuple[str, ...]
    vocab_size: int
    max_model_len: int
    eos_token_ids: tuple[int, ...]
    bos_token_id: int | None
    dtype: str
    """The checkpoint's dtype as torch spells it without the prefix: "float32", "bfloat16"."""
    gguf: bool = False
    """A GGUF file's folder view (its weights are the file's quantized blocks)."""


def _token_ids(value: Any) -> tuple[int, ...]:
    if value is None:
        return ()
    if isinstance(value, int):
        return (value,)
    return tuple(int(v) for v in value)


def _read_json(path: Path) -> dict[str, Any]:
    with path.open(encoding="utf-8") as f:
        data = json.load(f)
    if not isinstance(data, dict):
        raise ValueError(f"{path} does not hold a JSON object")
    return data


def _text_config(config: dict[str, Any]) -> dict[str, Any]:
    # Multimodal checkpoints nest the language model's settings.
    nested = config.get("text_config")
    return {**config, **nested} if isinstance(nested, dict) else config


def load_model_info(path: str | Path) -> ModelInfo:
    """Read a Hugging Face checkpoint folder's metadata (no weights are touched)."""
    folder = Path(path)
    config_path = folder / "config.json"
    if not config_path.is_file():
        raise FileNotFoundError(f"{folder} is not a model folder: it has no config.json")
    config = _text_config(_read_json(config_path))

    eos = _token_ids(config.get("eos_token_id"))
    bos = config.get("bos_token_id")
    generation_path = folder / "generation_config.json"
    if generation_path.is_file():
        generation = _read_json(generation_path)
        eos = _token_ids(generation.get("eos_token_id")) or eos
        bos = generation.get("bos_token_id", bos)

    max_model_len = next((int(config[k]) for k in _CONTEXT_LENGTH_KEYS if k in config), 0)
    if max_model_len <= 0:
        keys = ", ".join(_CONTEXT_LENGTH_KEYS)
        raise ValueError(f"{config_path} gives no context length (none of {keys})")
    # Transformers 5 writes "dtype"; older checkpoints say "torch_dtype".
    dtype = str(config.get("dtype") or config.get("torch_dtype") or "float32")
    dtype = dtype.removeprefix("torch.")

    # A GGUF file's folder view (services/common/gguf_checkpoint.py) is a cache folder
    # with a hash in its name: clients know the model by the file's.
    gguf_file = config.get(GGUF_FILE_KEY)
    return ModelInfo(
        name=Path(gguf_file).stem if gguf_file else folder.resolve().name,
        path=str(folder.resolve()),
        architectures=tuple(config.get("architectures") or ()),
        vocab_size=int(config["vocab_size"]),
        max_model_len=max_model_len,
        eos_token_ids=eos,
        bos_token_id=None if bos is None else int(bos),
        dtype=dtype,
        gguf=bool(gguf_file),
    )
