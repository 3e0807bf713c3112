from __future__ import annotations

import pytest

from services.common.convert import sampling_from_proto, sampling_to_proto
from services.common.sampling import SamplingParams

CASES = [
    SamplingParams(),
    SamplingParams(temperature=0.0, n=4, logprobs=0, prompt_logprobs=20),
    SamplingParams(
        temperature=0.5, top_p=0.75, top_k=40, min_p=0.25, seed=-(2**63), max_tokens=17,
        min_tokens=2, stop=("\n", "END"), stop_token_ids=(7, 9), ignore_eos=True,
        include_stop_str_in_output=True, repetition_penalty=1.5, presence_penalty=-0.5,
        frequency_penalty=0.25, logit_bias=((3, -1.0), (8, 2.5)), n=16, logprobs=20,
    ),
    SamplingParams(seed=2**63 - 1, prompt_logprobs=0),
]


@pytest.mark.parametrize("params", CASES)
def test_sampling_round_trips_through_proto(params: SamplingParams) -> None:
    assert sampling_from_proto(sampling_to_proto(params)) == params


def test_unset_logprobs_stay_unset_on_the_wire() -> None:
    pb = sampling_to_proto(SamplingParams())
    assert not pb.HasField("logprobs") and not pb.HasField("prompt_logprobs")
    assert sampling_from_proto(type(pb)()).n == 1
