"""Tiny random pooling checkpoints written by their reference libraries, with the
built-in tiny checkpoint's tokenizer: sentence-transformers embedders (a decoder plus
Pooling and maybe Normalize modules, saved by sentence-transformers itself) and
`*ForSequenceClassification` models (saved by transformers)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import torch
from sentence_transformers import SentenceTransformer
from sentence_transformers.sentence_transformer.modules import Normalize, Pooling, Transformer
from transformers import AutoModelForSequenceClassification, PreTrainedModel

from services.common.tiny_checkpoint import ensure_tiny_checkpoint
from tests.unit.engine.hf_checkpoints import CONFIG_CLASSES, make_checkpoint, randomize_norms

# Long enough for prompts past a small token budget (chunked prefill).
CONTEXT = 512
ST_MODES = {"LAST": "lasttoken", "MEAN": "mean", "CLS": "cls"}


def _tiny_vocab() -> int:
    return int(json.loads((ensure_tiny_checkpoint() / "config.json").read_text())["vocab_size"])


def copy_tokenizer(folder: Path) -> None:
    tiny = ensure_tiny_checkpoint()
    shutil.copy(tiny / "tokenizer.json", folder / "tokenizer.json")
    config = json.loads((tiny / "tokenizer_config.json").read_text())
    config["model_max_length"] = CONTEXT
    config["pad_token"] = "</s>"  # batches of texts pad (the attention mask hides it)
    (folder / "tokenizer_config.json").write_text(json.dumps(config))


def make_embedder(folder: Path, family: str = "qwen3", pooling: str = "LAST",
                  normalize: bool = True, prompts: dict[str, str] | None = None,
                  **overrides: Any) -> SentenceTransformer:
    """A sentence-transformers folder in `folder`; returns the model, in float32."""
    base = folder.parent / f"{folder.name}-decoder"
    make_checkpoint(base, family, vocab_size=_tiny_vocab(), max_position_embeddings=CONTEXT,
                    **overrides)
    copy_tokenizer(base)
    transformer = Transformer(str(base), max_seq_length=CONTEXT)
    modules: list[torch.nn.Module] = [
        transformer,
        Pooling(transformer.get_embedding_dimension(),
                       pooling_mode=ST_MODES[pooling])]
    if normalize:
        modules.append(Normalize())
    model = SentenceTransformer(modules=modules, prompts=prompts or {}, device="cpu")
    model.save(str(folder))
    return model.eval()


def make_classifier(folder: Path, family: str = "qwen3", num_labels: int = 3,
                    **overrides: Any) -> PreTrainedModel:
    """A `<Family>ForSequenceClassification` checkpoint in `folder`; returns it."""
    torch.manual_seed(0)
    config = CONFIG_CLASSES[family](
        vocab_size=_tiny_vocab(), hidden_size=64, intermediate_size=172, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=CONTEXT,
        initializer_range=0.15, num_labels=num_labels, pad_token_id=0,
        id2label={i: f"label-{i}" for i in range(num_labels)},
        label2id={f"label-{i}": i for i in range(num_labels)}, **overrides)
    model = randomize_norms(
        AutoModelForSequenceClassification.from_config(config, dtype=torch.float32))
    model.save_pretrained(folder)
    copy_tokenizer(folder)
    return model.eval()
