"""The tiny byte-level BPE tokenizer and model description (see fakes.py) as fixtures."""

from __future__ import annotations

from pathlib import Path

import pytest

from services.common.model_info import ModelInfo
from services.frontend.tokenizer import TextTokenizer
from tests.unit.frontend.fakes import BOS_ID, EOS_ID, MAX_MODEL_LEN, VOCAB_SIZE, build_tokenizer


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
