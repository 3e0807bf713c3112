"""The frontend's constraint check: verdicts per constraint, and a model whose
tokenizer llguidance refuses."""

from __future__ import annotations

import asyncio
import json

import grpc
import pytest
from tokenizers import Tokenizer, decoders, models

from services.common.constraints import ConstraintKind, OutputConstraint
from services.common.model_info import ModelInfo, load_model_info
from services.common.tiny_checkpoint import resolve_model
from services.frontend.errors import RequestError
from services.frontend.generate import constraint_check
from services.frontend.generate.constraint_check import ConstraintChecker
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


def tiny() -> tuple[TextTokenizer, ModelInfo]:
    path = resolve_model(None)
    return TextTokenizer.from_dir(path), load_model_info(path)


OVERLAP = OutputConstraint(ConstraintKind.JSON_SCHEMA, json.dumps(
    {"type": "object", "properties": {"v": {"oneOf": [{"enum": ["a", "b"]}, {"enum": ["b"]}]}}}))


def test_an_approximated_schema_is_served_with_an_output_check_unless_strict() -> None:
    tokenizer, info = tiny()
    accepted = asyncio.run(ConstraintChecker(tokenizer, info, 1 << 20).check(OVERLAP))
    assert accepted.output_check is not None
    assert accepted.checked.notes and "/properties/v/oneOf" in accepted.checked.notes[0]
    assert accepted.output_check.failure('{"v": "b"}') is not None
    assert accepted.output_check.failure('{"v": "a"}') is None

    strict = ConstraintChecker(tokenizer, info, 1 << 20, strict_json_schema=True)
    with pytest.raises(RequestError) as info_:
        asyncio.run(strict.check(OVERLAP))
    assert info_.value.code is grpc.StatusCode.INVALID_ARGUMENT
    assert "sampling.json_schema" in str(info_.value)
    assert "oneOf at /properties/v/oneOf" in str(info_.value)
    assert "strict_json_schema" in str(info_.value)


def test_verdicts_are_bounded_in_characters(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(constraint_check, "VERDICT_CACHE_CHARS", 100)
    tokenizer, info = tiny()
    checker = ConstraintChecker(tokenizer, info, 1000)
    regexes = [OutputConstraint(ConstraintKind.REGEX, f"[0-9]{{{i}}}" + "x" * 40)
               for i in range(1, 5)]
    for regex in regexes:
        asyncio.run(checker.check(regex))
    # 46-47 characters each: two fit, the oldest went first.
    assert list(checker._verdicts) == regexes[2:]
