"""Embed on the pooling path, against a scripted pooling engine: what PoolingService's
Embed answers for the same ids."""

from __future__ import annotations

import asyncio

import grpc
import numpy as np
import pytest
from corestream.common.v1 import common_pb2
from corestream.engine.v1 import engine_core_service_pb2 as engine_pb2
from corestream.generate.v1 import generate_service_pb2 as generate_pb2
from corestream.generate.v1 import pooling_service_pb2 as pooling_pb2
from corestream.generate.v1 import pooling_service_pb2_grpc as pooling_grpc
from corestream.vendor.smg_grpc_proto import vllm_engine_pb2 as vllm_pb2
from corestream.vendor.smg_grpc_proto import vllm_engine_pb2_grpc as vllm_grpc

from services.common.model_info import ModelInfo
from services.common.pooling import Pooler, PoolingTask, PoolingType
from services.frontend.tokenizer import TextTokenizer
from tests.unit.frontend.fakes import FakeEngine, serve_generate

pytestmark = pytest.mark.timeout(60)


class PoolingEngine(FakeEngine):
    """Pools a prompt into [length, sum of ids, 0.5, -1]."""

    async def _generate(self, add: engine_pb2.AddRequest,
                        out: asyncio.Queue[engine_pb2.SessionResponse | None]) -> None:
        ids = list(add.prompt_token_ids)
        values = np.array([len(ids), sum(ids), 0.5, -1.0], dtype="<f4")
        out.put_nowait(engine_pb2.SessionResponse(outputs=[engine_pb2.RequestOutput(
            request_id=add.request_id, finish_reason=common_pb2.FINISH_REASON_LENGTH,
            num_cached_tokens=0, pooled=values.tobytes(), pooled_shape=[4])]))


def test_embed_answers_as_pooling_service(tokenizer: TextTokenizer,
                                          model_info: ModelInfo) -> None:
    pooler = Pooler(PoolingTask.EMBED, PoolingType.MEAN, normalize=False, hidden_size=4)

    async def body(_: object, channel: grpc.aio.Channel) -> None:
        stub = vllm_grpc.VllmEngineStub(channel)
        ids = [5, 6, 7]
        ours = await pooling_grpc.PoolingServiceStub(channel).Embed(
            pooling_pb2.EmbedRequest(inputs=[pooling_pb2.PoolingInput(
                token_ids=generate_pb2.TokenIds(ids=ids))]))
        theirs = await stub.Embed(vllm_pb2.EmbedRequest(
            request_id="e1", tokenized=vllm_pb2.TokenizedInput(input_ids=ids)))
        assert list(theirs.embedding) == list(ours.embeddings[0].values) == [
            3.0, 18.0, 0.5, -1.0]
        assert (theirs.embedding_dim, theirs.prompt_tokens) == (4, 3)
        # The text alone is tokenized.
        text = await stub.Embed(vllm_pb2.EmbedRequest(
            tokenized=vllm_pb2.TokenizedInput(original_text="hello world")))
        assert text.prompt_tokens == len(tokenizer.encode("hello world"))
        with pytest.raises(grpc.aio.AioRpcError) as error:
            await stub.Embed(vllm_pb2.EmbedRequest(
                tokenized=vllm_pb2.TokenizedInput(input_ids=[5, 99999])))
        assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "tokenized.input_ids" in (error.value.details() or "")
        info = await stub.GetModelInfo(vllm_pb2.GetModelInfoRequest())
        assert not info.is_generation

    serve_generate(tokenizer, model_info, PoolingEngine([]), body, pooler=pooler)
