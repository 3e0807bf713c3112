"""The frontend's constraint check: verdicts per constraint, and a model whose
tokenizer llguidance refuses."""

from __future__ import annotations

import asyncio

import grpc
import pytest
from tokenizers import Tokenizer, decoders, models

from services.common.constraints import ConstraintKind, OutputConstraint
from services.common.model_info import ModelInfo
from services.frontend.constraint_check import ConstraintChecker
from services.frontend.errors import RequestError
from services.frontend.tokenizer import TextTokenizer

REGEX = OutputConstraint(ConstraintKind.REGEX, "[0-9]+")


def model(vocab_size: int) -> ModelInfo:
    return ModelInfo("m", "", ("LlamaForCausalLM",), vocab_size, 64, (0,), None, "float32")


def word_level() -> TextTokenizer:
    vocab = {f"w{i}": i for i in range(64)} | {"[UNK]": 64}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tokenizer.decoder = decoders.WordPiece()
    return TextTokenizer(tokenizer)


def test_a_tokenizer_llguidance_refuses_is_failed_precondition_not_the_requests_fault() -> None:
    checker = ConstraintChecker(word_level(), model(65), max_chars=1000)
    with pytest.raises(RequestError) as info:
        asyncio.run(checker.check(REGEX))
    assert info.value.code is grpc.StatusCode.FAILED_PRECONDITION
    assert "cannot serve output constraints" in str(info.value)


def test_the_size_limit_comes_before_any_compile() -> None:
    checker = ConstraintChecker(word_level(), model(65), max_chars=5)
    with pytest.raises(RequestError) as info:
        asyncio.run(checker.check(REGEX))
    assert info.value.code is grpc.StatusCode.INVALID_ARGUMENT
    assert "sampling.regex has 6 characters, at most 5" in str(info.value)
