"""The tokenizer rebuilt from SmolLM2's GGUF metadata against llama.cpp's on the same file.

llama.cpp's ids were recorded by benchmarks/llama_cpp_reference.py (`llama_tokenize` with
parse_special on, as our tokenizer always matches the special tokens in the text) for the
texts of tests/data/gguf/tokenizer_corpus.json and the reference's prompts; the file adds
no BOS, so with and without add_special the ids should be ours with and without
`add_special_tokens`.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from tokenizers import Tokenizer

from tests.gguf_models import CORPUS, HELD_TEXT


@pytest.fixture(scope="module")
def tokenizer(smollm2_view: Path) -> Tokenizer:
    return Tokenizer.from_file(str(smollm2_view / "tokenizer.json"))


def test_corpus_ids_equal_llama_cpps(tokenizer: Tokenizer,
                                     smollm2_llama_cpp: dict[str, Any]) -> None:
    texts = {e["name"]: e["text"] for e in json.loads(CORPUS.read_text("utf-8"))["texts"]}
    recorded = smollm2_llama_cpp["tokenizer"]
    assert sorted(recorded["add_special_false"]) == sorted(texts)
    for name, text in texts.items():
        for add_special in (False, True):
            theirs = recorded[f"add_special_{str(add_special).lower()}"][name]
            ours = tokenizer.encode(text, add_special_tokens=add_special).ids
            assert ours == theirs, (name, add_special)


def test_prompt_ids_equal_llama_cpps(tokenizer: Tokenizer,
                                     smollm2_llama_cpp: dict[str, Any]) -> None:
    # The rendered chat prompts: markers, newlines and the system prompt.
    for name, prompt in smollm2_llama_cpp["teacher_forced"]["prompts"].items():
        assert tokenizer.encode(prompt["text"], add_special_tokens=False).ids == (
            prompt["prompt_ids"]), name
    held = HELD_TEXT.read_text("utf-8")
    assert tokenizer.encode(held, add_special_tokens=False).ids == (
        smollm2_llama_cpp["perplexity"]["token_ids"])
