"""VllmEngine (`vllm.grpc.engine`): vLLM's gRPC engine API, as the smg gateway and
other routers call vLLM workers, served by the frontend on corestream's own paths.

- Generate walks the one request path (pipeline.py) through its public steps, as
  ChatService does (request, checks, tokenize, prepared, run): the same validation,
  limits, routing, telemetry, time limit, and an abort of every sample when the client
  goes away. The request is translated at the door (generate_request.py) and the
  chunks on the way out (generate_response.py).
- Embed runs on the pooling path (pooling/operations.py), Abort on the runner's
  registry of client request ids, FlushCache and the profiler on the engines' utility
  calls (weight_sync.py's fan-out, as AdminService does).
- GetLoads and GetServerInfo read the routing's load view (loads.py), GetTokenizer
  zips the model folder's tokenizer files (tokenizer_archive.py), SubscribeKvEvents
  relays every engine's prefix-cache events (kv_events.py).

The vendored generated code (protos/corestream/vendor/smg_grpc_proto/) is the only
protobuf code of this API here: the smg-grpc-proto package registers the same
message names and the two cannot live in one process.
"""

from __future__ import annotations

import asyncio
import importlib.metadata
import json
import logging
import time
from collections.abc import AsyncIterator, Mapping
from pathlib import Path

import grpc
from corestream.vendor.smg_grpc_proto import common_pb2 as smg_common_pb2
from corestream.vendor.smg_grpc_proto import vllm_engine_pb2 as vllm_pb2
from corestream.vendor.smg_grpc_proto import vllm_engine_pb2_grpc as vllm_pb2_grpc

from services.common.model_info import ModelInfo
from services.frontend.config import FrontendConfig
from services.frontend.errors import RequestError, invalid_argument, to_status
from services.frontend.generate.runner import PreparedRequest
from services.frontend.generate.telemetry import RequestTelemetry
from services.frontend.generate.validation import check_prompt_token_ids
from services.frontend.grpc_calls import aborting_on_error, call_metadata, start_call
from services.frontend.pipeline import Pipeline
from services.frontend.pooling.operations import PoolingOperations
from services.frontend.routing.balancer import Balancer
from services.frontend.vllm_grpc.generate_request import (
    to_generate_request,
    truncated,
    vllm_field_names,
)
from services.frontend.vllm_grpc.generate_response import ResponseBuilder
from services.frontend.vllm_grpc.kv_events import KvEventHub
from services.frontend.vllm_grpc.loads import KvTokens, loads_response
from services.frontend.vllm_grpc.tokenizer_archive import TokenizerArchive, chunks
from services.frontend.weight_sync import Results, WeightSync, all_ok, result_json

log = logging.getLogger(__name__)

SERVICE_NAME = vllm_pb2.DESCRIPTOR.services_by_name["VllmEngine"].full_name
ADMIN_METHODS = tuple(f"/{SERVICE_NAME}/{m}" for m in ("FlushCache", "StartProfile",
                                                       "StopProfile"))
"""Operator calls: with admin keys configured, they need one (as AdminService does)."""
# Routers may pick their client by it: this is the vLLM API, whoever serves it.
SERVER_TYPE = "vllm-grpc"
PAUSE_LOOKUP_TIMEOUT_S = 1.0
_FLUSH_RETRY_S = 0.1
_PROFILE_OPTIONS = ("output_dir", "start_step", "num_steps", "with_stack", "record_shapes")


def _version() -> str:
    try:
        return f"corestream {importlib.metadata.version('corestream')}"
    except importlib.metadata.PackageNotFoundError:
        return "corestream"


class VllmEngineServicer(vllm_pb2_grpc.VllmEngineServicer):
    def __init__(self, config: FrontendConfig, pipeline: Pipeline, pooling: PoolingOperations,
                 model: ModelInfo, balancer: Balancer, weight_sync: WeightSync,
                 kv_events: KvEventHub, kv_tokens: KvTokens = lambda address: 0) -> None:
        """`kv_tokens`: an engine's KV-cache size in tokens by address (0: unknown)."""
        self._config = config
        self._pipeline = pipeline
        self._pooling = pooling
        self._model = model
        self._balancer = balancer
        self._weights = weight_sync
        self._kv_events = kv_events
        self._kv_tokens = kv_tokens
        template = Path(config.chat_template) if config.chat_template else None
        self._tokenizer = TokenizerArchive(Path(model.path), template)
        self._model_config = _read_config(Path(model.path))
        self._version = _version()
        self._started = time.time()
        self._last_receive = 0.0

    # ---- generation -----------------------------------------------------------------

    async def Generate(  # noqa: N802 (gRPC method name)
        self, request: vllm_pb2.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[vllm_pb2.GenerateResponse]:
        request_id = await start_call(request.request_id, context)
        self._last_receive = time.time()
        responses = self._generate(request_id, request, call_metadata(context))
        async for response in aborting_on_error(responses, context):
            yield response

    async def _generate(self, request_id: str, request: vllm_pb2.GenerateRequest,
                        metadata: Mapping[str, str]
                        ) -> AsyncIterator[vllm_pb2.GenerateResponse]:
        params = request.sampling_params
        try:
            async with self._pipeline.request(request_id, metadata) as telemetry:
                prepared = await self._prepare(request_id, request, telemetry)
                builder = ResponseBuilder(
                    prepared.prompt_token_ids, request.stream,
                    params.logprobs if params.HasField("logprobs") else None,
                    params.prompt_logprobs if params.HasField("prompt_logprobs") else None)
                async for chunk in self._pipeline.run(prepared, telemetry):
                    response = builder.on_chunk(chunk)
                    if response is not None:
                        yield response
        except RequestError as e:
            raise vllm_field_names(e) from None
        for complete in builder.completes():
            yield complete

    async def _prepare(self, request_id: str, request: vllm_pb2.GenerateRequest,
                       telemetry: RequestTelemetry) -> PreparedRequest:
        """The request path's steps as GenerateService's request takes them, with the
        prompt tokenized here: its length is in every response, and
        truncate_prompt_tokens cuts it before the length limits apply."""
        pipeline = self._pipeline
        with telemetry.phase("validate"):
            ours = to_generate_request(request_id, request)
            pipeline.check_accepting()
            sampling = pipeline.check_sampling(ours.sampling)
            text = ours.text if ours.WhichOneof("prompt") == "text" else None
            if text is None:
                check_prompt_token_ids(ours.token_ids.ids, self._model.vocab_size)
        if text is None:
            token_ids = list(ours.token_ids.ids)
        else:
            with telemetry.phase("tokenize"):
                token_ids = await pipeline.encode(text, add_special_tokens=True)
        token_ids = truncated(token_ids, request.sampling_params, self._model.max_model_len)
        return await pipeline.prepared(PreparedRequest(
            request_id=request_id, prompt_token_ids=token_ids, sampling=sampling,
            skip_special_tokens=ours.skip_special_tokens,
            data_parallel_rank=(ours.data_parallel_rank
                                if ours.HasField("data_parallel_rank") else None),
        ), text, telemetry)

    async def Abort(  # noqa: N802 (gRPC method name)
        self, request: vllm_pb2.AbortRequest, context: grpc.aio.ServicerContext
    ) -> vllm_pb2.AbortResponse:
        aborted = self._pipeline.abort(list(request.request_ids))
        if aborted:
            log.info("aborted %d request(s) on request (vLLM API)", len(aborted))
        return vllm_pb2.AbortResponse()

    async def Embed(  # noqa: N802 (gRPC method name)
        self, request: vllm_pb2.EmbedRequest, context: grpc.aio.ServicerContext
    ) -> vllm_pb2.EmbedResponse:
        request_id = await start_call(request.request_id, context)
        self._last_receive = time.time()
        tokenized = request.tokenized
        # vLLM embeds the ids; a request with only the text gets it tokenized here.
        item: str | list[int] = list(tokenized.input_ids) or tokenized.original_text
        try:
            done = await self._pooling.embed(request_id, [item], call_metadata(context),
                                             field="tokenized.input_ids")
        except RequestError as e:
            await context.abort_with_status(to_status(e))
        values = done.results[0].values.ravel()
        return vllm_pb2.EmbedResponse(embedding=values.tolist(),
                                      prompt_tokens=done.num_prompt_tokens,
                                      embedding_dim=int(values.size))

    # ---- state ------------------------------------------------------------------------

    async def HealthCheck(  # noqa: N802 (gRPC method name)
        self, request: vllm_pb2.HealthCheckRequest, context: grpc.aio.ServicerContext
    ) -> vllm_pb2.HealthCheckResponse:
        if self._pipeline.draining:
            return vllm_pb2.HealthCheckResponse(healthy=False, message="draining")
        if not self._balancer.ready:
            return vllm_pb2.HealthCheckResponse(
                healthy=False, message=f"no engine accepts requests "
                f"({self._balancer.num_connected} connected)")
        return vllm_pb2.HealthCheckResponse(
            healthy=True, message=f"{self._balancer.num_connected} engine(s) connected")

    async def GetModelInfo(  # noqa: N802 (gRPC method name)
        self, request: vllm_pb2.GetModelInfoRequest, context: grpc.aio.ServicerContext
    ) -> vllm_pb2.GetModelInfoResponse:
        model, config = self._model, self._model_config
        pad = config.get("pad_token_id")
        return vllm_pb2.GetModelInfoResponse(
            model_path=model.path, is_generation=self._pipeline.pooler is None,
            max_context_length=model.max_model_len, vocab_size=model.vocab_size,
            supports_vision=False,
            served_model_name=self._config.served_model_name or model.name,
            tokenizer_path=model.path, model_type=str(config.get("model_type", "")),
            architectures=model.architectures, eos_token_ids=model.eos_token_ids,
            # -1: the model names none (0 is a token id).
            pad_token_id=pad if isinstance(pad, int) else -1,
            bos_token_id=-1 if model.bos_token_id is None else model.bos_token_id,
            # A prompt must leave room for one token, whatever --max-prompt-tokens says.
            max_req_input_len=min(self._config.max_prompt_tokens or model.max_model_len,
                                  model.max_model_len - 1),
            # The frontend applies no per-model sampling defaults (generation_config.json's
            # are not read): the request's values and ours are all there is.
            default_sampling_params_json="{}")

    async def GetServerInfo(  # noqa: N802 (gRPC method name)
        self, request: vllm_pb2.GetServerInfoRequest, context: grpc.aio.ServicerContext
    ) -> vllm_pb2.GetServerInfoResponse:
        ranks = {c.engine_index for c in self._balancer.clients if c.connected}
        block_sizes = self._kv_events.block_sizes()
        # Paused as AdminService.IsPaused says: every engine answered and is paused. A
        # router polls this: an engine slow to answer makes it "not paused", not slow.
        stats = await self._weights.call(self._weights.clients(), "get_stats", {},
                                         PAUSE_LOOKUP_TIMEOUT_S)
        paused = bool(stats) and all_ok(stats) and all(
            result_json(r).get("paused") for r in stats)
        return vllm_pb2.GetServerInfoResponse(
            active_requests=self._pipeline.num_running, is_paused=paused,
            last_receive_timestamp=self._last_receive,
            uptime_seconds=time.time() - self._started, server_type=SERVER_TYPE,
            data_parallel_size=len(ranks), model_dtype=self._model.dtype,
            block_size=min(block_sizes) if len(block_sizes) == 1 else 0)

    async def GetLoads(  # noqa: N802 (gRPC method name)
        self, request: vllm_pb2.GetLoadsRequest, context: grpc.aio.ServicerContext
    ) -> vllm_pb2.GetLoadsResponse:
        try:
            return loads_response(self._balancer, self._version,
                                  request.dp_rank if request.HasField("dp_rank") else None,
                                  self._kv_tokens)
        except RequestError as e:
            await context.abort_with_status(to_status(e))
            raise  # not reached: abort raises

    async def GetTokenizer(  # noqa: N802 (gRPC method name)
        self, request: smg_common_pb2.GetTokenizerRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[smg_common_pb2.GetTokenizerChunk]:
        try:
            data, sha256 = await self._tokenizer.get()
        except OSError as e:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                                f"cannot bundle the tokenizer: {e}")
        for chunk in chunks(data, sha256):
            yield chunk

    async def SubscribeKvEvents(  # noqa: N802 (gRPC method name)
        self, request: smg_common_pb2.SubscribeKvEventsRequest,
        context: grpc.aio.ServicerContext
    ) -> AsyncIterator[smg_common_pb2.KvEventBatch]:
        batches = self._kv_events.subscribe(request.start_sequence_number)
        async for batch in aborting_on_error(batches, context):
            yield batch

    # ---- engine utilities -------------------------------------------------------------

    async def FlushCache(  # noqa: N802 (gRPC method name)
        self, request: smg_common_pb2.FlushCacheRequest, context: grpc.aio.ServicerContext
    ) -> smg_common_pb2.FlushCacheResponse:
        if request.timeout_s < 0:
            await context.abort_with_status(to_status(invalid_argument(
                "timeout_s", f"timeout_s must be >= 0, got {request.timeout_s:g}")))
        # An engine refuses while requests hold KV blocks (as vLLM does): with a timeout,
        # ask again until every engine has flushed or the time is up.
        deadline = time.monotonic() + request.timeout_s
        while True:
            results = await self._call_engines(context, "reset_prefix_cache", {})
            if all_ok(results) or time.monotonic() >= deadline:
                break
            await asyncio.sleep(_FLUSH_RETRY_S)
        return smg_common_pb2.FlushCacheResponse(success=all_ok(results),
                                                 message=_summary(results))

    async def StartProfile(  # noqa: N802 (gRPC method name)
        self, request: smg_common_pb2.StartProfileRequest, context: grpc.aio.ServicerContext
    ) -> smg_common_pb2.ProfileResponse:
        # Where and how the engines profile is their own configuration (--profile-dir).
        for name in _PROFILE_OPTIONS:
            if request.HasField(name):
                await _refuse(context, name, "set the engines' profiler with their own "
                              "flags (--profile-dir); this call only starts it")
        if request.activities or request.profile_by_stage:
            await _refuse(context, "activities" if request.activities else "profile_by_stage",
                          "the engines' profiler records what their flags say")
        results = await self._call_engines(context, "profile", {"action": "start"})
        return smg_common_pb2.ProfileResponse(success=all_ok(results), message=_summary(results))

    async def StopProfile(  # noqa: N802 (gRPC method name)
        self, request: smg_common_pb2.StopProfileRequest, context: grpc.aio.ServicerContext
    ) -> smg_common_pb2.ProfileResponse:
        results = await self._call_engines(context, "profile", {"action": "stop"})
        return smg_common_pb2.ProfileResponse(success=all_ok(results), message=_summary(results))

    async def _call_engines(self, context: grpc.aio.ServicerContext, method: str,
                            args: dict[str, object]) -> Results:
        try:
            clients = self._weights.clients()
        except RequestError as e:
            await context.abort_with_status(to_status(e))
        return await self._weights.call(clients, method, args)


async def _refuse(context: grpc.aio.ServicerContext, field: str, why: str) -> None:
    await context.abort_with_status(to_status(invalid_argument(
        field, f"{field} is not supported: {why}")))


def _summary(results: Results) -> str:
    """One line per engine: its rank and what it answered."""
    return "; ".join(
        f"engine {r.engine_index}: " + ((r.result_json or "ok") if r.ok else r.message)
        for r in results)


def _read_config(folder: Path) -> dict[str, object]:
    try:
        config = json.loads((folder / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return config if isinstance(config, dict) else {}
