"""Tokenizers rebuilt from GGUF metadata (services/common/gguf_tokenizer.py) against
transformers' GGUF converter, on small synthetic vocabularies: SentencePiece (`llama`)
and byte-level BPE (`gpt2`) under the split rules of several `tokenizer.ggml.pre` names.
The real file's tokenizer is checked in test_gguf_checkpoint.py.
"""

from __future__ import annotations

import json
from typing import Any

import pytest

from services.common.gguf_tokenizer import build_tokenizer
from services.common.tiny_checkpoint import ensure_tiny_checkpoint

converter = pytest.importorskip("transformers.integrations.gguf.gguf_tokenizer_mapping")

TEXTS = ["hello world", "the abc", "  hello", "hello</s>world", "héllo wörld 漢字", "", "a\nb",
         "Numbers 12345 and 3.14!", "don't\n\n  indent\tTabs", "<s>x</s>"]
# Metadata keys -> the names transformers' converter takes them under.
_CONVERTER_KEYS = {"model": "tokenizer_type", "pre": "pre_tokenizer_type", "tokens": "tokens",
                   "scores": "scores", "token_type": "token_type", "merges": "merges",
                   "bos_token_id": "bos_token_id", "eos_token_id": "eos_token_id",
                   "unknown_token_id": "unk_token_id", "add_space_prefix": "add_prefix_space"}


def sentencepiece_metadata() -> dict[str, Any]:
    pieces = ["▁", *"abcdehlortw", "▁h", "he", "ll", "llo", "▁hello", "▁w", "or", "orld",
              "▁world", "▁the", "th", "▁a", "ab", "abc"]
    tokens = ["<unk>", "<s>", "</s>", *[f"<0x{b:02X}>" for b in range(256)], *pieces]
    return {
        "tokenizer.ggml.model": "llama",
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.scores": [0.0] * 259 + [-float(i) for i in range(len(pieces))],
        "tokenizer.ggml.token_type": [2, 3, 3, *[6] * 256, *[1] * len(pieces)],
        "tokenizer.ggml.bos_token_id": 1,
        "tokenizer.ggml.eos_token_id": 2,
        "tokenizer.ggml.unknown_token_id": 0,
        "tokenizer.ggml.add_space_prefix": True,
    }


def byte_level_metadata(pre: str) -> dict[str, Any]:
    """The tiny checkpoint's byte-level BPE as a GGUF would store it."""
    spec = json.loads((ensure_tiny_checkpoint() / "tokenizer.json").read_text())
    vocab: dict[str, int] = spec["model"]["vocab"]
    tokens = sorted(vocab, key=vocab.__getitem__)
    special = {t["content"] for t in spec["added_tokens"]}
    return {
        "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.pre": pre,
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.token_type": [3 if t in special else 1 for t in tokens],
        "tokenizer.ggml.merges": [" ".join(m) if isinstance(m, list) else m
                                  for m in spec["model"]["merges"]],
        "tokenizer.ggml.bos_token_id": 1,
        "tokenizer.ggml.eos_token_id": 2,
        "tokenizer.ggml.add_bos_token": True,
    }


def transformers_tokenizer(metadata: dict[str, Any]) -> Any:
    fields = {_CONVERTER_KEYS[k.removeprefix("tokenizer.ggml.")]: v
              for k, v in metadata.items()
              if k.removeprefix("tokenizer.ggml.") in _CONVERTER_KEYS}
    return converter.convert_gguf_tokenizer("llama", fields)[0]


@pytest.mark.parametrize("metadata", [
    pytest.param(sentencepiece_metadata(), id="sentencepiece"),
    *[pytest.param(byte_level_metadata(pre), id=f"bpe-{pre}")
      for pre in ("gpt2", "qwen2", "llama-bpe")],
])
def test_ids_agree_with_transformers_converter(metadata: dict[str, Any]) -> None:
    ours, theirs = build_tokenizer(metadata), transformers_tokenizer(metadata)
    for text in TEXTS:
        assert (ours.encode(text, add_special_tokens=False).ids
                == theirs.encode(text, add_special_tokens=False).ids), text


def test_bos_is_added_as_the_file_says() -> None:
    tokenizer = build_tokenizer(sentencepiece_metadata())
    assert tokenizer.encode("hello").ids[0] == 1
    assert tokenizer.decode(tokenizer.encode("hello world").ids) == "hello world"
    assert build_tokenizer(byte_level_metadata("gpt2")).encode("hello").ids[0] == 1


def test_unknown_pre_tokenizer_is_refused() -> None:
    with pytest.raises(ValueError, match="pre-tokenizer 'made-up'"):
        build_tokenizer(byte_level_metadata("made-up"))
