"""PoolingService: the gRPC door onto the pooling operations (operations.py)."""

from __future__ import annotations

import grpc
from corestream.generate.v1 import pooling_service_pb2 as pb
from corestream.generate.v1 import pooling_service_pb2_grpc as pb_grpc

from services.common.pooling import PoolingType
from services.frontend.config import FrontendConfig
from services.frontend.errors import RequestError, to_status
from services.frontend.grpc_calls import call_metadata, start_call
from services.frontend.pooling.operations import Embedded, Input, PoolingOperations

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["PoolingService"].full_name

_POOLING_TYPES = {pb.POOLING_TYPE_LAST: PoolingType.LAST, pb.POOLING_TYPE_MEAN: PoolingType.MEAN,
                  pb.POOLING_TYPE_CLS: PoolingType.CLS, pb.POOLING_TYPE_ALL: PoolingType.ALL}


class PoolingServicer(pb_grpc.PoolingServiceServicer):
    def __init__(self, config: FrontendConfig, operations: PoolingOperations) -> None:
        self._model_name = config.served_model_name
        self._ops = operations

    async def Embed(  # noqa: N802 (gRPC method name)
        self, request: pb.EmbedRequest, context: grpc.aio.ServicerContext
    ) -> pb.EmbedResponse:
        request_id = await start_call("", context)
        try:
            done = await self._ops.embed(
                request_id, _inputs(request.inputs, "inputs"), call_metadata(context),
                dimensions=request.dimensions if request.HasField("dimensions") else None,
                pooling_type=_POOLING_TYPES.get(request.pooling_type),
                normalize=request.normalize if request.HasField("normalize") else None,
                truncate=request.truncate,
                prompt_name=request.prompt_name if request.HasField("prompt_name") else None)
        except RequestError as e:
            await context.abort_with_status(to_status(e))
        return pb.EmbedResponse(
            embeddings=[pb.Embedding(index=i, values=r.values.ravel().tolist(),
                                     rows=r.values.shape[0] if r.values.ndim == 2 else 1,
                                     num_tokens=r.num_tokens)
                        for i, r in enumerate(done.results)],
            model=self._name(), usage=_usage(done), weight_version=done.weight_version)

    async def Classify(  # noqa: N802 (gRPC method name)
        self, request: pb.ClassifyRequest, context: grpc.aio.ServicerContext
    ) -> pb.ClassifyResponse:
        request_id = await start_call("", context)
        try:
            done = await self._ops.classify(
                request_id, _inputs(request.inputs, "inputs"), call_metadata(context),
                truncate=request.truncate,
                activation=request.activation if request.HasField("activation") else None)
        except RequestError as e:
            await context.abort_with_status(to_status(e))
        labels = self._ops.pooler.labels if self._ops.pooler is not None else ()
        return pb.ClassifyResponse(
            results=[pb.Classification(index=i, probs=r.values.tolist(),
                                       label=labels[int(r.values.argmax())] if labels else "",
                                       num_tokens=r.num_tokens)
                     for i, r in enumerate(done.results)],
            model=self._name(), usage=_usage(done), weight_version=done.weight_version)

    async def Score(  # noqa: N802 (gRPC method name)
        self, request: pb.ScoreRequest, context: grpc.aio.ServicerContext
    ) -> pb.ScoreResponse:
        request_id = await start_call("", context)
        try:
            query = _input(request.query, "query")
            done = await self._ops.score(request_id, query, _inputs(request.documents,
                                                                    "documents"),
                                         call_metadata(context), truncate=request.truncate)
        except RequestError as e:
            await context.abort_with_status(to_status(e))
        return pb.ScoreResponse(
            results=[pb.ScoreResult(index=i, score=s) for i, s in enumerate(done.scores)],
            model=self._name(),
            usage=pb.PoolingUsage(prompt_tokens=done.num_prompt_tokens,
                                  total_tokens=done.num_prompt_tokens),
            weight_version=done.weight_version)

    def _name(self) -> str:
        return self._model_name or self._ops.model_name


def _inputs(inputs: list[pb.PoolingInput], field: str) -> list[Input]:
    return [_input(item, f"{field}[{i}]") for i, item in enumerate(inputs)]


def _input(item: pb.PoolingInput, field: str) -> Input:
    kind = item.WhichOneof("input")
    if kind == "text":
        return item.text
    if kind == "token_ids":
        return list(item.token_ids.ids)
    raise RequestError(grpc.StatusCode.INVALID_ARGUMENT, f"{field} has neither text nor "
                       "token_ids", field=field)


def _usage(done: Embedded) -> pb.PoolingUsage:
    return pb.PoolingUsage(prompt_tokens=done.num_prompt_tokens,
                           total_tokens=done.num_prompt_tokens)
