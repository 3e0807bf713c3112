"""n samples per request and logprobs, through the frontend against a scripted engine."""

from __future__ import annotations

import asyncio

import grpc
import pytest
from corestream.common.v1 import common_pb2
from corestream.generate.v1 import generate_service_pb2 as pb
from corestream.generate.v1 import generate_service_pb2_grpc as pb_grpc

from services.common.model_info import ModelInfo
from services.frontend.tokenizer import TextTokenizer
from tests.unit.frontend.fakes import FakeEngine, script, serve_generate


@pytest.mark.timeout(60)
def test_stream_interleaves_samples_and_sums_usage(
    tokenizer: TextTokenizer, model_info: ModelInfo
) -> None:
    # In lockstep: the frontend adds the siblings only once sample 0's first token is
    # back, and on timers alone a loaded machine let sample 0 send its next tokens
    # before the siblings started (then the first three chunks were all sample 0's).
    engine = FakeEngine(script(tokenizer), lockstep=3)

    async def body(stub: pb_grpc.GenerateServiceStub, channel: grpc.aio.Channel) -> None:
        sampling = common_pb2.SamplingParams(n=3, seed=10, max_tokens=4, prompt_logprobs=1)
        chunks = [c async for c in stub.GenerateStream(
            pb.GenerateStreamRequest(request_id="r", text="hello", sampling=sampling))]
        for index in range(3):
            mine = [c for c in chunks if c.index == index]
            assert [t for c in mine for t in c.token_ids] == engine.script[:4]
            assert [bool(c.finish_reason) for c in mine] == [False] * (len(mine) - 1) + [True]
        # Interleaved, not one after another: every sample's first token comes before
        # any sample's second.
        assert sorted(c.index for c in chunks[:3]) == [0, 1, 2]
        assert all(not c.HasField("usage") for c in chunks[:-1])
        prompt = tokenizer.encode("hello")
        assert chunks[-1].usage == common_pb2.Usage(
            prompt_tokens=len(prompt), completion_tokens=12, cached_tokens=2)
        # Prompt logprobs once, in the stream's first chunk, from sample 0 only.
        assert len(chunks[0].prompt_logprobs) == len(prompt) - 1
        assert all(not c.prompt_logprobs for c in chunks[1:])
        assert [a.request_id for a in engine.adds] == ["r-0", "r-1", "r-2"]
        assert [a.sampling.seed for a in engine.adds] == [10, 11, 12]
        assert [a.sampling.HasField("prompt_logprobs") for a in engine.adds] == [
            True, False, False]

    serve_generate(tokenizer, model_info, engine, body)


@pytest.mark.timeout(60)
def test_unary_completions_with_logprobs_and_token_text(
    tokenizer: TextTokenizer, model_info: ModelInfo
) -> None:
    engine = FakeEngine(script(tokenizer))

    async def body(stub: pb_grpc.GenerateServiceStub, channel: grpc.aio.Channel) -> None:
        sampling = common_pb2.SamplingParams(n=2, max_tokens=3, logprobs=2, prompt_logprobs=0,
                                             stop_token_ids=[engine.script[1]])
        response = await stub.Generate(pb.GenerateRequest(text="hello", sampling=sampling))
        assert [c.index for c in response.completions] == [0, 1]
        for completion in response.completions:
            assert list(completion.token_ids) == engine.script[:2]
            assert completion.text == tokenizer.decode(engine.script[:2])
            assert completion.finish_reason == common_pb2.FINISH_REASON_STOP_TOKEN
            assert completion.stop_token_id == engine.script[1]
            assert [lp.token_id for lp in completion.logprobs] == engine.script[:2]
            assert [lp.rank for lp in completion.logprobs] == [1, 2]
            for lp in completion.logprobs:
                assert lp.token == tokenizer.token_texts([lp.token_id])[0] != ""
                assert lp.token_bytes == lp.token.encode()
                assert [t.token for t in lp.top] == tokenizer.token_texts(
                    [t.token_id for t in lp.top])
                assert len(lp.top) == 2
        prompt = tokenizer.encode("hello")
        assert [lp.token_id for lp in response.prompt_logprobs] == prompt[1:]
        assert [lp.token for lp in response.prompt_logprobs] == tokenizer.token_texts(
            prompt[1:])
        assert response.usage.completion_tokens == 4

    serve_generate(tokenizer, model_info, engine, body)


@pytest.mark.timeout(60)
def test_no_logprobs_unless_asked(tokenizer: TextTokenizer, model_info: ModelInfo) -> None:
    engine = FakeEngine(script(tokenizer))

    async def body(stub: pb_grpc.GenerateServiceStub, channel: grpc.aio.Channel) -> None:
        response = await stub.Generate(pb.GenerateRequest(text="hello"))
        assert not response.prompt_logprobs and not response.completions[0].logprobs
        (add,) = engine.adds
        assert not add.sampling.HasField("logprobs")
        assert add.request_id == response.request_id  # n = 1 keeps the client's id

    serve_generate(tokenizer, model_info, engine, body)


@pytest.mark.timeout(60)
def test_abort_rpc_and_cancel_end_every_sample(
    tokenizer: TextTokenizer, model_info: ModelInfo
) -> None:
    engine = FakeEngine(script(tokenizer), step_s=0.1)

    async def body(stub: pb_grpc.GenerateServiceStub, channel: grpc.aio.Channel) -> None:
        sampling = common_pb2.SamplingParams(n=2)
        call = stub.GenerateStream(
            pb.GenerateStreamRequest(request_id="p", text="hello", sampling=sampling))
        await call.read()
        response = await stub.Abort(pb.AbortRequest(request_ids=["p"]))
        assert list(response.aborted_request_ids) == ["p"]
        rest = []
        while (chunk := await call.read()) is not grpc.aio.EOF:
            rest.append(chunk)
        finishes = {c.index: c.finish_reason for c in rest if c.finish_reason}
        assert finishes == {0: common_pb2.FINISH_REASON_ABORT, 1: common_pb2.FINISH_REASON_ABORT}
        assert rest[-1].HasField("usage")
        # The client's stream ends as soon as the frontend has queued the aborts on its
        # Session; they reach the engine over the network after that.
        async with asyncio.timeout(5):
            while not {"p-0", "p-1"} <= set(engine.aborts):
                await asyncio.sleep(0.01)

        engine.aborts.clear()
        call = stub.GenerateStream(
            pb.GenerateStreamRequest(request_id="q", text="hello", sampling=sampling))
        await call.read()
        while len({a.request_id for a in engine.adds} & {"q-0", "q-1"}) < 2:
            await asyncio.sleep(0.01)
        call.cancel()
        async with asyncio.timeout(5):
            while not {"q-0", "q-1"} <= set(engine.aborts):
                await asyncio.sleep(0.01)

    serve_generate(tokenizer, model_info, engine, body)
