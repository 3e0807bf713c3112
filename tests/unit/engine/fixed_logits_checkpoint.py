"""A checkpoint of the fixed-logits stand-in model (services/engine/models/fixed_logits.py)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
from safetensors.numpy import save_file

VOCAB = 50


def write_checkpoint(folder: Path, logits: np.ndarray, **extra: Any) -> Path:
    folder.mkdir()
    config = {
        "architectures": ["CorestreamFixedLogitsForCausalLM"], "hidden_size": 8,
        "intermediate_size": 8, "num_hidden_layers": 1, "num_attention_heads": 1,
        "num_key_value_heads": 1, "vocab_size": VOCAB, "max_position_embeddings": 128,
        "eos_token_id": 2, "dtype": "float32", **extra,
    }
    (folder / "config.json").write_text(json.dumps(config))
    save_file({"logits": logits.astype(np.float32)}, str(folder / "model.safetensors"))
    return folder
