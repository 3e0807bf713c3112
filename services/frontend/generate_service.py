"""GenerateService: the gRPC door onto the request path (pipeline.py).

Generate and GenerateStream run through `Pipeline.generate`; the rest (Tokenize,
Detokenize, GetModelInfo, Abort) answer from the tokenizer, the model and the
balancer.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator

import grpc
from corestream.generate.v1 import generate_service_pb2 as generate_pb2
from corestream.generate.v1 import generate_service_pb2_grpc as generate_pb2_grpc

from services.common.model_info import ModelInfo
from services.common.restart_status import given_up_engines
from services.frontend.collect import collect_generate
from services.frontend.config import FrontendConfig
from services.frontend.errors import invalid_argument, to_status
from services.frontend.grpc_calls import aborting_on_error, call_metadata, start_call
from services.frontend.pipeline import Pipeline
from services.frontend.routing.balancer import Balancer
from services.frontend.tokenizer import TextTokenizer

log = logging.getLogger(__name__)

SERVICE_NAME = generate_pb2.DESCRIPTOR.services_by_name["GenerateService"].full_name


class GenerateServicer(generate_pb2_grpc.GenerateServiceServicer):
    def __init__(self, config: FrontendConfig, pipeline: Pipeline, tokenizer: TextTokenizer,
                 model: ModelInfo, balancer: Balancer) -> None:
        self._config = config
        self._pipeline = pipeline
        self._tokenizer = tokenizer
        self._model = model
        self._balancer = balancer

    async def GenerateStream(
        self, request: generate_pb2.GenerateStreamRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[generate_pb2.GenerateStreamResponse]:
        request_id = await start_call(request.request_id, context)
        async for chunk in aborting_on_error(
                self._pipeline.generate(request_id, request, call_metadata(context)), context):
            yield chunk

    async def Generate(
        self, request: generate_pb2.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> generate_pb2.GenerateResponse:
        request_id = await start_call(request.request_id, context)
        chunks = self._pipeline.generate(request_id, request, call_metadata(context))
        return await collect_generate(request_id, aborting_on_error(chunks, context))

    async def Tokenize(
        self, request: generate_pb2.TokenizeRequest, context: grpc.aio.ServicerContext
    ) -> generate_pb2.TokenizeResponse:
        add_special = request.add_special_tokens if request.HasField("add_special_tokens") else True
        token_ids = await self._pipeline.encode(request.text, add_special)
        return generate_pb2.TokenizeResponse(
            token_ids=token_ids, tokens=self._tokenizer.token_strings(token_ids)
        )

    async def Detokenize(
        self, request: generate_pb2.DetokenizeRequest, context: grpc.aio.ServicerContext
    ) -> generate_pb2.DetokenizeResponse:
        skip = request.skip_special_tokens if request.HasField("skip_special_tokens") else True
        for i, token_id in enumerate(request.token_ids):
            if token_id >= self._tokenizer.vocab_size:
                error = invalid_argument(
                    "token_ids",
                    f"token_ids[{i}] = {token_id} is out of the tokenizer's vocabulary "
                    f"(token ids must be < {self._tokenizer.vocab_size})",
                )
                await context.abort_with_status(to_status(error))
        text = self._tokenizer.decode(list(request.token_ids), skip_special_tokens=skip)
        return generate_pb2.DetokenizeResponse(text=text)

    async def GetModelInfo(
        self, request: generate_pb2.GetModelInfoRequest, context: grpc.aio.ServicerContext
    ) -> generate_pb2.GetModelInfoResponse:
        model = self._model
        response = generate_pb2.GetModelInfoResponse(
            model=self._config.served_model_name or model.name,
            architectures=model.architectures,
            max_context_length=model.max_model_len,
            vocab_size=model.vocab_size,
            eos_token_ids=model.eos_token_ids,
            dtype=model.dtype,
            num_engines=self._balancer.num_connected,
            degraded=self._balancer.degraded,
            tensor_parallel_size=self._balancer.tensor_parallel_size,
            engines_given_up=given_up_engines(self._config.restart_status_file),
            weight_version=self._balancer.weight_version,
        )
        pooler = self._pipeline.pooler
        if pooler is None:
            response.tasks.append("generate")
        else:
            response.tasks.extend(pooler.tasks)
            response.pooling_dimensions = pooler.dimensions
            response.labels.extend(pooler.labels)
        if model.bos_token_id is not None:
            response.bos_token_id = model.bos_token_id
        return response

    async def Abort(
        self, request: generate_pb2.AbortRequest, context: grpc.aio.ServicerContext
    ) -> generate_pb2.AbortResponse:
        aborted = self._pipeline.abort(list(request.request_ids))
        if aborted:
            log.info("aborted %d request(s) on request", len(aborted))
        return generate_pb2.AbortResponse(aborted_request_ids=aborted)
