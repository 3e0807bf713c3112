"""N-gram lookup and `--speculative-config` parsing (no torch)."""

from __future__ import annotations

import json

import numpy as np
import pytest

from services.engine.config import EngineConfig
from services.engine.request import Request
from services.engine.speculative.config import SpeculativeConfig
from services.engine.speculative.ngram import NgramProposer, propose_from


def lookup(tokens: list[int], k: int = 4, lo: int = 2, hi: int = 5) -> list[int]:
    return propose_from(np.array(tokens, dtype=np.int64), k, lo, hi)


def test_the_tokens_after_the_earlier_occurrence_of_the_suffix_are_proposed() -> None:
    assert lookup([5, 6, 7, 8, 9, 1, 5, 6]) == [7, 8, 9, 1]
    assert lookup([5, 6, 7, 8, 9, 1, 5, 6], k=2) == [7, 8]


def test_the_longest_suffix_wins_then_the_latest_occurrence() -> None:
    # "2 3" occurs at 1 and 6; "1 2 3" only at 0: the longer match decides.
    assert lookup([1, 2, 3, 40, 50, 9, 2, 3, 60, 1, 2, 3]) == [40, 50, 9, 2]
    # Two occurrences of the same length: the latest one, unless only an earlier one
    # is followed by a whole proposal.
    assert lookup([7, 8, 1, 7, 8, 2, 7, 8], k=3) == [2, 7, 8]
    assert lookup([7, 8, 1, 7, 8, 2, 7, 8], k=4) == [1, 7, 8, 2]


def test_no_match_shorter_than_the_minimum_and_nothing_after_the_end() -> None:
    assert lookup([1, 2, 3, 4, 9, 4]) == []  # only a 1-token suffix recurs
    assert lookup([1, 2, 3, 4, 9, 4], lo=1) == [9, 4]
    assert lookup([3, 4]) == []
    assert lookup([1, 2, 1, 2], k=0) == []


def test_a_suffix_longer_than_the_maximum_is_matched_on_its_last_tokens() -> None:
    tokens = list(range(10, 30)) + [99] + list(range(10, 30))
    # The last 3 tokens (27 28 29) recur at 17..19, followed by 99.
    assert lookup(tokens, lo=2, hi=3) == [99, 10, 11, 12]


def test_the_proposer_keeps_each_request_s_tokens_as_it_grows() -> None:
    proposer = NgramProposer(2, 5)
    r = Request("a", [1, 2, 3, 4, 1, 2])
    assert proposer.propose(r, 3) == [3, 4, 1]
    r.output_token_ids += [3, 4, 9]
    assert proposer.propose(r, 3) == []  # "4 9" never occurred before
    r.output_token_ids += [1, 2, 3]
    assert proposer.propose(r, 2) == [4, 9]
    proposer.forget("a")
    assert proposer.propose(Request("a", [8, 9, 8]), 2) == []  # forgotten: read afresh


@pytest.mark.parametrize(("text", "message"), [
    ("[1]", "must be a JSON object"),
    ("{bad", "not valid JSON"),
    ('{"num_speculative_tokens": 4}', "'method' is required"),
    ('{"method": "ngram"}', "'num_speculative_tokens' is required"),
    ('{"method": "eagle", "num_speculative_tokens": 4}', "method must be one of"),
    ('{"method": "draft_model", "num_speculative_tokens": 4}', "needs a model"),
    ('{"method": "ngram", "num_speculative_tokens": 4, "model": "x"}', "model is for method"),
    ('{"method": "ngram", "num_speculative_tokens": 0}', "num_speculative_tokens must be"),
    ('{"method": "ngram", "num_speculative_tokens": 4.5}', "num_speculative_tokens must be"),
    ('{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 4, '
     '"prompt_lookup_max": 2}', "prompt_lookup_min (4) must not exceed prompt_lookup_max (2)"),
    ('{"method": "ngram", "num_speculative_tokens": 4, "min_acceptance_rate": 2}',
     "min_acceptance_rate must be"),
    ('{"method": "ngram", "num_speculative_tokens": 4, "draft": "x"}', "unknown key(s) ['draft']"),
])
def test_a_bad_config_is_refused_naming_the_key(text: str, message: str) -> None:
    with pytest.raises(ValueError) as refused:
        EngineConfig(speculative_config=text)
    assert message in str(refused.value)
    assert "speculative_config" in str(refused.value)


def test_a_good_config_in_vllm_s_shape() -> None:
    text = json.dumps({"method": "ngram", "num_speculative_tokens": 3,
                       "prompt_lookup_max": 1})
    assert EngineConfig(speculative_config=text).speculative == SpeculativeConfig(
        "ngram", 3, prompt_lookup_min=1, prompt_lookup_max=1)
    assert EngineConfig().speculative is None
