"""A tiny byte-level BPE tokenizer and model description for frontend tests."""

from __future__ import annotations

from pathlib import Path

import pytest
from tokenizers import Tokenizer

from services.common.model_info import ModelInfo
from services.common.tiny_checkpoint import train_byte_level_bpe
from services.frontend.tokenizer import TextTokenizer

BOS_ID = 0
EOS_ID = 1
VOCAB_SIZE = 300
MAX_MODEL_LEN = 64

_CORPUS = [
    "hello world, the quick brown fox jumps over the lazy dog.",
    "a stream of tokens becomes a stream of text; stop here. STOP",
]


def build_tokenizer() -> Tokenizer:
    tokenizer = train_byte_level_bpe(_CORPUS * 10, VOCAB_SIZE, ("<s>", "</s>"))
    assert tokenizer.token_to_id("<s>") == BOS_ID and tokenizer.token_to_id("</s>") == EOS_ID
    return tokenizer


@pytest.fixture(scope="session")
def tokenizer() -> TextTokenizer:
    return TextTokenizer(build_tokenizer())


@pytest.fixture(scope="session")
def model_info() -> ModelInfo:
    return ModelInfo(
        name="tiny-test",
        path=str(Path("/nonexistent")),
        architectures=("LlamaForCausalLM",),
        vocab_size=VOCAB_SIZE,
        max_model_len=MAX_MODEL_LEN,
        eos_token_ids=(EOS_ID,),
        bos_token_id=BOS_ID,
        dtype="float32",
    )
