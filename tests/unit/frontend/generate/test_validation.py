from __future__ import annotations

import math
from typing import Any

import grpc
import pytest
from corestream.common.v1 import common_pb2

from services.frontend.errors import RequestError
from services.frontend.generate.validation import (
    MAX_STOP_STRING_CHARS,
    MAX_STOP_STRINGS,
    check_length,
    check_prompt_text,
    check_prompt_token_ids,
    check_sampling,
)

VOCAB = 300

BAD_SAMPLING: list[tuple[dict[str, Any], str, str]] = [
    # (SamplingParams fields, field named in the message, limit named in the message)
    ({"temperature": -1}, "sampling.temperature", ">= 0, got -1"),
    ({"temperature": math.nan}, "sampling.temperature", ">= 0"),
    ({"temperature": math.inf}, "sampling.temperature", "finite"),
    ({"top_p": 0}, "sampling.top_p", "(0, 1]"),
    ({"top_p": 1.5}, "sampling.top_p", "(0, 1], got 1.5"),
    ({"top_k": -2}, "sampling.top_k", ">= -1"),
    ({"min_p": -0.1}, "sampling.min_p", "[0, 1]"),
    ({"min_p": 1.1}, "sampling.min_p", "[0, 1]"),
    ({"repetition_penalty": 0}, "sampling.repetition_penalty", "> 0"),
    ({"presence_penalty": 2.5}, "sampling.presence_penalty", "[-2, 2]"),
    ({"frequency_penalty": -3}, "sampling.frequency_penalty", "[-2, 2]"),
    ({"max_tokens": 0}, "sampling.max_tokens", ">= 1, got 0"),
    ({"min_tokens": -1}, "sampling.min_tokens", ">= 0"),
    ({"min_tokens": 5, "max_tokens": 4}, "sampling.min_tokens", "<= sampling.max_tokens (4)"),
    ({"logit_bias": {VOCAB: 1.0}}, "sampling.logit_bias", f"< vocab_size {VOCAB}"),
    ({"stop_token_ids": [3, VOCAB + 5]}, "sampling.stop_token_ids", f"< vocab_size {VOCAB}"),
    ({"stop": ["x"] * (MAX_STOP_STRINGS + 1)}, "sampling.stop", f"at most {MAX_STOP_STRINGS}"),
    ({"stop": ["y" * (MAX_STOP_STRING_CHARS + 1)]}, "sampling.stop",
     f"at most {MAX_STOP_STRING_CHARS}"),
    ({"stop": [""]}, "sampling.stop", "empty"),
    ({"n": 0}, "sampling.n", "[1, 16], got 0"),
    ({"n": 17}, "sampling.n", "[1, 16], got 17"),
    ({"logprobs": -1}, "sampling.logprobs", "[0, 20], got -1"),
    ({"logprobs": 21}, "sampling.logprobs", "[0, 20], got 21"),
    ({"prompt_logprobs": 21}, "sampling.prompt_logprobs", "[0, 20], got 21"),
]


@pytest.mark.parametrize(("fields", "field", "limit"), BAD_SAMPLING)
def test_bad_sampling_is_invalid_argument(fields: dict[str, Any], field: str, limit: str) -> None:
    with pytest.raises(RequestError) as info:
        check_sampling(common_pb2.SamplingParams(**fields), VOCAB)
    assert info.value.code == grpc.StatusCode.INVALID_ARGUMENT
    assert info.value.field == field
    assert field in info.value.message
    assert limit in info.value.message


def test_good_sampling_converts_with_defaults() -> None:
    params = check_sampling(
        common_pb2.SamplingParams(temperature=0, top_k=-1, stop=["\n"], logit_bias={5: -1.0}),
        VOCAB,
    )
    assert params.temperature == 0 and params.top_k == 0 and params.top_p == 1.0
    assert params.stop == ("\n",) and params.logit_bias == ((5, -1.0),)
    assert (params.n, params.logprobs, params.prompt_logprobs) == (1, None, None)


def test_samples_and_logprobs_at_their_bounds() -> None:
    params = check_sampling(
        common_pb2.SamplingParams(temperature=0, n=16, logprobs=0, prompt_logprobs=20), VOCAB
    )
    # n > 1 with greedy sampling is allowed: the samples are identical.
    assert (params.n, params.logprobs, params.prompt_logprobs) == (16, 0, 20)


def test_empty_prompts() -> None:
    for check in (lambda: check_prompt_text(""), lambda: check_prompt_token_ids([], VOCAB)):
        with pytest.raises(RequestError, match="prompt is empty") as info:
            check()
        assert info.value.code == grpc.StatusCode.INVALID_ARGUMENT


def test_prompt_token_out_of_vocab() -> None:
    with pytest.raises(RequestError, match=r"token_ids.ids\[1\] = 300 .* < vocab_size 300"):
        check_prompt_token_ids([1, VOCAB], VOCAB)


def test_length_limits_name_the_limit() -> None:
    assert check_length(10, None, 64) == 54
    assert check_length(10, 54, 64) == 54
    with pytest.raises(RequestError, match="max_model_len.* is 64 tokens") as info:
        check_length(64, None, 64)
    assert info.value.reason == "PROMPT_TOO_LONG"
    with pytest.raises(RequestError, match=r"sampling.max_tokens \(55\) exceeds .* 64") as info:
        check_length(10, 55, 64)
    assert info.value.field == "sampling.max_tokens"
    with pytest.raises(RequestError, match=r"max_prompt_tokens \(8\)"):
        check_length(10, None, 64, max_prompt_tokens=8)
