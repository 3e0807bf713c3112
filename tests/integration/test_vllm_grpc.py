"""vLLM's gRPC engine API on a real `corestream serve --engines 2`, driven by the official
client stubs of smg-grpc-proto (in a process of their own: vllm_grpc_client.py says why).

Greedy outputs must equal our own GenerateService's for the same prompt; the sampling
parameters, abort, the state RPCs, the tokenizer bundle and the KV-event stream (with
each stored block's token ids) must do what vLLM's servicer does.
"""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
from corestream.common.v1 import common_pb2
from corestream.generate.v1 import generate_service_pb2 as pb
from corestream.generate.v1 import generate_service_pb2_grpc as pb_grpc

from services.common.tiny_checkpoint import resolve_model
from tests.integration.cluster import REPO, Cluster

pytestmark = pytest.mark.timeout(240)

BLOCK = 16
PROMPT = [3 + (i * 37) % 350 for i in range(2 * BLOCK + 5)]

Json = dict[str, Any]


@pytest.fixture(scope="module")
def cluster() -> Iterator[Cluster]:
    # Routing that needs no cache events: SubscribeKvEvents must get them anyway.
    c = Cluster(["--engines", "2", "--routing-policy", "least_load"])
    yield c
    c.stop()


@pytest.fixture(scope="module")
def ours(cluster: Cluster) -> Iterator[pb_grpc.GenerateServiceStub]:
    with grpc.insecure_channel(cluster.address) as channel:
        yield pb_grpc.GenerateServiceStub(channel)


def client(cluster: Cluster, scenario: str, **args: Any) -> Json:
    done = subprocess.run(
        [sys.executable, "-m", "tests.integration.vllm_grpc_client", cluster.address, scenario,
         json.dumps(args)], cwd=REPO, capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, done.stderr + "\n" + cluster.output()
    result: Json = json.loads(done.stdout)
    return result


def vllm_generate(cluster: Cluster, **request: Any) -> list[Json]:
    result = client(cluster, "generate", request=request)
    assert "error" not in result, result
    responses: list[Json] = result["responses"]
    return responses


def streamed_ids(responses: list[Json], index: int = 0) -> list[int]:
    return [t for r in responses if "chunk" in r and r["chunk"].get("index", 0) == index
            for t in r["chunk"].get("token_ids", [])]


def completes(responses: list[Json]) -> list[Json]:
    return [r["complete"] for r in responses if "complete" in r]


def our_greedy(stub: pb_grpc.GenerateServiceStub, max_tokens: int, **prompt: Any) -> list[int]:
    response = stub.Generate(pb.GenerateRequest(sampling=common_pb2.SamplingParams(
        temperature=0.0, max_tokens=max_tokens, ignore_eos=True), **prompt), timeout=60)
    return list(response.completions[0].token_ids)


def test_greedy_token_ids_equal_our_generate_service(
        cluster: Cluster, ours: pb_grpc.GenerateServiceStub) -> None:
    expected = our_greedy(ours, 12, token_ids=pb.TokenIds(ids=PROMPT))
    params = {"temperature": 0.0, "max_tokens": 12, "ignore_eos": True}
    streamed = vllm_generate(cluster, request_id="greedy-1", stream=True,
                             tokenized={"input_ids": PROMPT}, sampling_params=params)
    assert streamed_ids(streamed) == expected
    (complete,) = completes(streamed)
    assert complete["finish_reason"] == "length"
    assert (complete["prompt_tokens"], complete["completion_tokens"]) == (len(PROMPT), 12)
    unary = vllm_generate(cluster, tokenized={"input_ids": PROMPT}, sampling_params=params)
    assert [c["output_ids"] for c in completes(unary)] == [expected]
    # A text prompt is tokenized as ours is.
    text = "the cluster serves vLLM's own API"
    assert completes(vllm_generate(cluster, text=text, sampling_params=params))[0][
        "output_ids"] == our_greedy(ours, 12, text=text)


def test_sampling_parameters_take_effect(cluster: Cluster,
                                         ours: pb_grpc.GenerateServiceStub) -> None:
    greedy = our_greedy(ours, 8, token_ids=pb.TokenIds(ids=PROMPT))
    stop_at = greedy[3]
    first = greedy.index(stop_at)  # the stop token may come earlier than position 3
    stopped = completes(vllm_generate(cluster, tokenized={"input_ids": PROMPT}, sampling_params={
        "temperature": 0.0, "max_tokens": 8, "ignore_eos": True, "stop_token_ids": [stop_at]}))
    assert stopped[0]["output_ids"] == greedy[:first + 1]
    assert stopped[0]["finish_reason"] == "stop"
    assert stopped[0]["matched_token_id"] == stop_at

    seeded = {"temperature": 1.0, "top_p": 0.9, "top_k": 50, "min_p": 0.01, "seed": 7,
              "max_tokens": 10, "ignore_eos": True, "n": 2, "logprobs": 2}
    one = completes(vllm_generate(cluster, tokenized={"input_ids": PROMPT},
                                  sampling_params=seeded))
    streamed = vllm_generate(cluster, tokenized={"input_ids": PROMPT}, stream=True,
                             sampling_params=seeded)
    assert [c.get("index", 0) for c in one] == [0, 1]
    # The seed: the same samples again, streamed as two interleaved sequences.
    assert [streamed_ids(streamed, i) for i in (0, 1)] == [c["output_ids"] for c in one]
    assert [c.get("index", 0) for c in completes(streamed)] == [0, 1]
    assert {len(top["token_ids"]) for r in streamed if "chunk" in r
            for top in r["chunk"]["output_logprobs"]["top_logprobs"]} == {2}
    for complete in one:
        assert len(complete["output_ids"]) == 10
        logprobs = complete["output_logprobs"]
        assert logprobs["token_ids"] == complete["output_ids"]
        assert {len(top["token_ids"]) for top in logprobs["top_logprobs"]} == {2}


def test_bad_input_is_invalid_argument_naming_the_field(cluster: Cluster) -> None:
    for request, field in [
            ({"text": "hi", "sampling_params": {"temperature": -1.0}},
             "sampling_params.temperature"),
            ({"tokenized": {"input_ids": [5, 100000]}}, "tokenized.input_ids"),
            ({"text": "hi", "mm_inputs": {"mm_hashes": ["x"]}}, "mm_inputs"),
            ({"text": "hi", "kv_transfer_params_json": '{"do_remote_prefill": true}'},
             "kv_transfer_params_json"),
            ({"text": "hi", "data_parallel_rank": 9}, "data_parallel_rank")]:
        error = client(cluster, "generate", request=request)["error"]
        assert error["code"] == "INVALID_ARGUMENT", (request, error)
        assert field in error["details"], (request, error)


def test_abort_ends_the_stream_with_abort(cluster: Cluster) -> None:
    result = client(cluster, "abort", request={
        "request_id": "to-abort", "stream": True, "tokenized": {"input_ids": PROMPT},
        "sampling_params": {"max_tokens": 64, "ignore_eos": True}})
    (complete,) = completes(result["responses"])
    assert complete["finish_reason"] == "abort"
    assert result["active_after"] == 0


def test_state_rpcs(cluster: Cluster, ours: pb_grpc.GenerateServiceStub) -> None:
    result = client(cluster, "info")
    assert result["health"]["healthy"] is True
    model = ours.GetModelInfo(pb.GetModelInfoRequest(), timeout=10)
    info = result["model"]
    assert (info["vocab_size"], info["max_context_length"], info["eos_token_ids"]) == (
        model.vocab_size, model.max_context_length, list(model.eos_token_ids))
    assert info["is_generation"] is True and info["served_model_name"] == model.model
    server = result["server"]
    assert server["server_type"] == "vllm-grpc"
    assert (server["data_parallel_size"], server["block_size"]) == (2, BLOCK)
    loads = result["loads"]
    assert loads["dp_rank_count"] == 2
    assert sorted(load.get("dp_rank", 0) for load in loads["loads"]) == [0, 1]
    # The KV cache's size, as the frontend read it from each engine's GetEngineInfo.
    assert all(load.get("max_total_num_tokens", 0) > 0 for load in loads["loads"])
    assert result["flush"]["success"] is True, result["flush"]
    assert result["flush"]["message"].count("num_blocks_dropped") == 2  # every engine


def test_server_info_says_when_every_engine_is_paused(cluster: Cluster) -> None:
    assert client(cluster, "paused") == {"before": False, "during": True, "after": False}


def test_tokenizer_bundle_holds_the_models_files(cluster: Cluster) -> None:
    result = client(cluster, "tokenizer")
    *earlier, last = result["sha256s"]
    assert last == result["sha256"] and not any(earlier)
    model_dir = Path(resolve_model(None))
    for name in ("tokenizer.json", "config.json"):
        assert result["members"][name] == hashlib.sha256(
            (model_dir / name).read_bytes()).hexdigest()


def test_kv_events_carry_the_stored_blocks_token_ids(cluster: Cluster) -> None:
    prompt = [7 + (i * 11) % 300 for i in range(3 * BLOCK + 2)]
    result = client(cluster, "kv_events", block_size=BLOCK, request={
        "tokenized": {"input_ids": prompt}, "data_parallel_rank": 1,
        "sampling_params": {"temperature": 0.0, "max_tokens": 2, "ignore_eos": True}})
    assert completes(result["generated"]["responses"])[0]["finish_reason"] == "length"
    found = result["found"]
    assert found["dp_rank"] == 1  # where the request was pinned
    blocks = [b for e in found["events"] if "stored" in e for b in e["stored"]["blocks"]]
    stored = [b["token_ids"] for b in blocks]
    expected = [prompt[i:i + BLOCK] for i in range(0, 3 * BLOCK, BLOCK)]
    assert stored[:3] == expected  # one chain, in order
    assert {b["block_size"] for b in blocks} == {BLOCK}
    numbers = [int(b["sequence_number"]) for b in result["batches"]]
    assert numbers == list(range(1, len(numbers) + 1))  # from the first, no gaps
    assert result["resumed"]["sequence_number"] == found["sequence_number"]
