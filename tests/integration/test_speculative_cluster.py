"""Speculative decoding through the whole cluster (two engines): the frontend's features
that sit on top of the engine's tokens (stop strings cut mid-chunk, n samples, seeds,
min_tokens, max_tokens) answer exactly as a cluster without speculation does, and the
acceptance shows in the engines' stats."""

from __future__ import annotations

import json
from collections.abc import Iterator

import grpc
import pytest
from corestream.common.v1 import common_pb2
from corestream.generate.v1 import admin_service_pb2 as admin_pb
from corestream.generate.v1 import admin_service_pb2_grpc as admin_grpc
from corestream.generate.v1 import generate_service_pb2 as pb
from corestream.generate.v1 import generate_service_pb2_grpc as pb_grpc

from tests.integration.cluster import Cluster

pytestmark = pytest.mark.timeout(300)
SPEC = json.dumps({"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1,
                   "min_acceptance_rate": 0.0, "disable_by_batch_size": 16})
# Text that repeats itself, so lookups find matches in it.
TEXT = "the cat sat on the mat and the cat sat on the mat and the dog"


@pytest.fixture(scope="module")
def clusters() -> Iterator[tuple[Cluster, Cluster]]:
    plain = Cluster(["--engines", "2"])
    try:
        spec = Cluster(["--engines", "2", "--speculative-config", SPEC])
    except BaseException:
        plain.stop()
        raise
    yield plain, spec
    spec.stop()
    plain.stop()


def generate(cluster: Cluster, sampling: common_pb2.SamplingParams) -> pb.GenerateResponse:
    with grpc.insecure_channel(cluster.address) as channel:
        return pb_grpc.GenerateServiceStub(channel).Generate(
            pb.GenerateRequest(text=TEXT, sampling=sampling), timeout=120)


def answers(response: pb.GenerateResponse) -> list[tuple[str, list[int], int, str]]:
    return [(c.text, list(c.token_ids), c.finish_reason, c.stop_string)
            for c in response.completions]


def test_frontend_features_answer_as_without_speculation(
        clusters: tuple[Cluster, Cluster]) -> None:
    plain, spec = clusters
    free = common_pb2.SamplingParams(temperature=0.0, max_tokens=60, ignore_eos=True)
    text = generate(plain, free).completions[0].text
    # A stop string taken from the middle of the plain answer: it must cut the speculating
    # cluster's answer at the same place, wherever it falls in a multi-token chunk.
    stop = text[len(text) // 2 : len(text) // 2 + 4]
    cases = [
        free,
        common_pb2.SamplingParams(temperature=0.0, max_tokens=60, ignore_eos=True,
                                  stop=[stop]),
        common_pb2.SamplingParams(temperature=0.0, max_tokens=37, min_tokens=30),
        common_pb2.SamplingParams(temperature=0.8, seed=5, n=2, max_tokens=50,
                                  ignore_eos=True),
        common_pb2.SamplingParams(temperature=0.7, seed=9, max_tokens=40, ignore_eos=True,
                                  repetition_penalty=1.2, stop=[stop]),
    ]
    for sampling in cases:
        assert answers(generate(spec, sampling)) == answers(generate(plain, sampling)), sampling
    cut = generate(spec, cases[1]).completions[0]
    assert cut.finish_reason == common_pb2.FINISH_REASON_STOP_STRING and cut.stop_string == stop
    with grpc.insecure_channel(spec.address) as channel:
        stats = admin_grpc.AdminServiceStub(channel).GetEngineStats(
            admin_pb.GetEngineStatsRequest(), timeout=20)
    speculation = [json.loads(r.result_json)["speculative_decoding"] for r in stats.results]
    assert len(speculation) == 2
    assert sum(s["num_accepted_tokens"] for s in speculation) > 0
