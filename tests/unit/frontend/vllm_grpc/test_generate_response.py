"""Our stream chunks -> vLLM's GenerateResponses (chunks, then one Complete per sample)."""

from __future__ import annotations

import pytest
from corestream.common.v1 import common_pb2
from corestream.generate.v1 import generate_service_pb2 as pb
from corestream.vendor.smg_grpc_proto import vllm_engine_pb2 as vllm_pb2

from services.frontend.vllm_grpc.generate_response import FINISH_REASONS, ResponseBuilder

PROMPT = [10, 11, 12]


def position(token_id: int, logprob: float, top: int = 2) -> common_pb2.PositionLogprobs:
    return common_pb2.PositionLogprobs(
        token_id=token_id, logprob=logprob, rank=1,
        top=[common_pb2.TopLogprob(token_id=token_id + k, logprob=logprob - k)
             for k in range(top)])


def chunks_of_two_samples() -> list[pb.GenerateStreamResponse]:
    return [
        pb.GenerateStreamResponse(index=0, token_ids=[1, 2], logprobs=[
            position(1, -0.5), position(2, -1.0)], prompt_logprobs=[
            position(11, -2.0), position(12, -3.0)]),
        pb.GenerateStreamResponse(index=1, token_ids=[7], logprobs=[position(7, -0.25)]),
        pb.GenerateStreamResponse(index=1, token_ids=[8], logprobs=[position(8, -0.75)],
                                  finish_reason=common_pb2.FINISH_REASON_STOP_STRING,
                                  stop_string="zz"),
        pb.GenerateStreamResponse(index=0, token_ids=[3], logprobs=[position(3, -1.5)],
                                  finish_reason=common_pb2.FINISH_REASON_STOP_TOKEN,
                                  stop_token_id=3,
                                  usage=common_pb2.Usage(prompt_tokens=3, completion_tokens=4,
                                                         cached_tokens=2)),
    ]


def run(builder: ResponseBuilder, chunks: list[pb.GenerateStreamResponse]
        ) -> list[vllm_pb2.GenerateResponse]:
    out = [r for chunk in chunks if (r := builder.on_chunk(chunk)) is not None]
    return out + builder.completes()


def test_stream_sends_each_chunk_then_every_complete_in_index_order() -> None:
    out = run(ResponseBuilder(PROMPT, stream=True, num_logprobs=2, num_prompt_logprobs=2),
              chunks_of_two_samples())
    kinds = [r.WhichOneof("response") for r in out]
    assert kinds == ["chunk"] * 4 + ["complete"] * 2
    first = out[0].chunk
    assert list(first.token_ids) == [1, 2] and first.completion_tokens == 2
    assert first.prompt_tokens == 3 and first.index == 0
    # Prompt logprobs with the first chunk: every prompt token, the first without a value.
    assert list(first.input_logprobs.token_ids) == PROMPT
    assert [v.HasField("value") for v in first.input_logprobs.token_logprobs] == [
        False, True, True]
    assert list(first.output_logprobs.token_ids) == [1, 2]
    assert list(first.output_logprobs.top_logprobs[1].token_ids) == [2, 3]
    assert [c.chunk.index for c in out[1:4]] == [1, 1, 0]
    zero, one = out[4].complete, out[5].complete
    # Streamed: a Complete repeats the finishing chunk's tokens; counts are the sample's.
    assert (zero.index, list(zero.output_ids), zero.completion_tokens) == (0, [3], 3)
    assert (one.index, list(one.output_ids), one.completion_tokens) == (1, [8], 2)
    assert zero.finish_reason == one.finish_reason == "stop"
    assert zero.matched_token_id == 3 and zero.WhichOneof("matched_stop") == "matched_token_id"
    assert one.matched_stop_str == "zz"
    assert (zero.prompt_tokens, zero.cached_tokens) == (3, 2)
    assert not zero.HasField("input_logprobs")  # went with the first chunk


def test_unary_sends_only_completes_with_everything() -> None:
    out = run(ResponseBuilder(PROMPT, stream=False, num_logprobs=0, num_prompt_logprobs=0),
              chunks_of_two_samples())
    assert [r.WhichOneof("response") for r in out] == ["complete", "complete"]
    zero, one = out[0].complete, out[1].complete
    assert list(zero.output_ids) == [1, 2, 3] and list(one.output_ids) == [7, 8]
    assert list(zero.output_logprobs.token_logprobs) == [-0.5, -1.0, -1.5]
    # logprobs = 0: each token's own logprob, no alternatives (as vLLM).
    assert not zero.output_logprobs.top_logprobs
    assert list(zero.input_logprobs.token_ids) == PROMPT
    assert not zero.input_logprobs.top_logprobs
    assert (zero.completion_tokens, one.completion_tokens) == (3, 2)


def test_without_logprobs_there_are_none() -> None:
    out = run(ResponseBuilder(PROMPT, stream=True), [pb.GenerateStreamResponse(
        token_ids=[4], finish_reason=common_pb2.FINISH_REASON_LENGTH,
        usage=common_pb2.Usage(prompt_tokens=3, completion_tokens=1))])
    assert not out[0].chunk.HasField("output_logprobs")
    assert not out[0].chunk.HasField("input_logprobs")
    assert out[1].complete.finish_reason == "length"
    assert out[1].complete.WhichOneof("matched_stop") is None


def test_an_abort_with_no_new_token_sends_no_empty_chunk() -> None:
    out = run(ResponseBuilder(PROMPT, stream=True), [
        pb.GenerateStreamResponse(token_ids=[4]),
        pb.GenerateStreamResponse(finish_reason=common_pb2.FINISH_REASON_ABORT,
                                  usage=common_pb2.Usage(prompt_tokens=3, completion_tokens=1))])
    assert [r.WhichOneof("response") for r in out] == ["chunk", "complete"]
    assert out[1].complete.finish_reason == "abort"
    assert list(out[1].complete.output_ids) == [] and out[1].complete.completion_tokens == 1


@pytest.mark.parametrize("reason", [r for r in common_pb2.FinishReason.values() if r])
def test_every_finish_reason_has_a_vllm_name(reason: int) -> None:
    assert FINISH_REASONS[reason] in ("stop", "length", "abort", "error")
