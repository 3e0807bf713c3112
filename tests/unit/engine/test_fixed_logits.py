"""The fixed-logits stand-in model loads through the real loader and runner."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
from safetensors.numpy import save_file

from tests.unit.engine.runner_driver import generate, make_runner

VOCAB = 50


def write_checkpoint(folder: Path, logits: np.ndarray) -> Path:
    folder.mkdir()
    config = {
        "architectures": ["CorestreamFixedLogitsForCausalLM"], "hidden_size": 8,
        "intermediate_size": 8, "num_hidden_layers": 1, "num_attention_heads": 1,
        "num_key_value_heads": 1, "vocab_size": VOCAB, "max_position_embeddings": 128,
        "eos_token_id": 2, "dtype": "float32",
    }
    (folder / "config.json").write_text(json.dumps(config))
    save_file({"logits": logits.astype(np.float32)}, str(folder / "model.safetensors"))
    return folder


def test_every_step_samples_the_fixed_argmax(tmp_path: Path) -> None:
    logits = np.zeros(VOCAB)
    logits[17] = 5.0
    runner = make_runner(write_checkpoint(tmp_path / "fixed", logits))
    out = generate(runner, {"a": [1, 2, 3], "b": [4, 5, 6, 7, 8, 9]}, num_tokens=5,
                   first_chunk={"b": 2})
    assert out == {"a": [17] * 5, "b": [17] * 5}
