"""Fixtures that more than one integration test module uses."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from services.common.tiny_checkpoint import ensure_tiny_checkpoint


@pytest.fixture(scope="module")
def moe_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from tests.unit.engine.hf_checkpoints import make_checkpoint

    tiny = ensure_tiny_checkpoint()
    vocab = json.loads((tiny / "config.json").read_text())["vocab_size"]
    folder = tmp_path_factory.mktemp("mixtral")
    make_checkpoint(folder, "mixtral", vocab_size=vocab, num_local_experts=4,
                    num_experts_per_tok=2, intermediate_size=64, max_position_embeddings=256)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        if (tiny / name).exists():
            shutil.copy(tiny / name, folder / name)
    return folder
