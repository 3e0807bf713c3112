"""SGLang's native HTTP routes on the HTTP door, so that SGLang's model gateway
(sgl-model-gateway, smg) registers and routes to this server as an HTTP worker:

    GET  /server_info, /get_server_info    what the gateway reads when it registers a
    GET  /model_info, /get_model_info      worker (and, without /version, the mark of
                                           an SGLang worker)
    GET  /v1/loads                         each engine's load, one entry per DP rank
    GET  /health_generate                  200 once a one-token generation succeeds
    POST /generate                         SGLang's body: `text` or `input_ids` (one or a
                                           batch), `sampling_params`, `stream`, `rid`

/generate runs on the request path of /v1/completions (pipeline.py): the same
validation, limits, API keys, routing (`data_parallel_rank` pins an engine), telemetry,
abort on disconnect and error bodies, whose `param` names SGLang's fields. Its answer
is SGLang's: `{"text", "output_ids", "meta_info"}`, a list of those for a batch or
n > 1; streamed, each `data: ` event carries the text so far (SGLang's default, not
a delta) and the stream ends with `data: [DONE]`. What is not served is refused (400)
rather than ignored: logprobs, LoRA, structural tags, a streamed batch.
"""

from __future__ import annotations

import asyncio
import re
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from importlib import metadata
from typing import Annotated, Any, TypeVar

from corestream.common.v1 import common_pb2
from corestream.generate.v1 import generate_service_pb2 as generate_pb2
from pydantic import BaseModel, ConfigDict, Field
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from services.common.model_info import ModelInfo
from services.frontend.collect import collect_generate
from services.frontend.errors import RequestError, invalid_argument
from services.frontend.model_server_metrics import EngineLoad
from services.frontend.openai_api import http_calls
from services.frontend.openai_api.http_errors import error_response
from services.frontend.openai_api.schemas import REQUEST_ID, Int32, Int64, TokenId
from services.frontend.openai_api.sse import sse_response
from services.frontend.pipeline import Pipeline

Json = dict[str, Any]
T = TypeVar("T")

# SGLang's default when sampling_params has no max_new_tokens.
DEFAULT_MAX_NEW_TOKENS = 128
HEALTH_GENERATE_TIMEOUT_S = 20.0
_TOKEN_ID_KEY = re.compile(r"[0-9]{1,10}")
# SGLang's sampling_params name -> ours (SamplingParams), where they differ.
_SAMPLING_NAMES = {"max_new_tokens": "max_tokens", "min_new_tokens": "min_tokens",
                   "sampling_seed": "seed", "no_stop_trim": "include_stop_str_in_output",
                   "ebnf": "grammar"}
_FINISH_TYPES = {
    common_pb2.FINISH_REASON_LENGTH: "length",
    common_pb2.FINISH_REASON_EOS_TOKEN: "stop",
    common_pb2.FINISH_REASON_STOP_TOKEN: "stop",
    common_pb2.FINISH_REASON_STOP_STRING: "stop",
    common_pb2.FINISH_REASON_STOP: "stop",
    common_pb2.FINISH_REASON_ABORT: "abort",
    common_pb2.FINISH_REASON_PAUSED: "abort",
    common_pb2.FINISH_REASON_SCHEMA_MISMATCH: "stop",
}


class SamplingParamsBody(BaseModel):
    # Fields SGLang takes that change nothing here (spaces_between_special_tokens,
    # custom_params, ...) are ignored; those that would change the output are refused.
    model_config = ConfigDict(extra="ignore")

    max_new_tokens: Int32 | None = None
    min_new_tokens: Int32 | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: Int32 | None = None
    min_p: float | None = None
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    repetition_penalty: float | None = None
    n: Int32 | None = None
    sampling_seed: Int64 | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[TokenId] | None = None
    ignore_eos: bool = False
    skip_special_tokens: bool | None = None
    no_stop_trim: bool = False
    logit_bias: dict[str, float] | None = None
    json_schema: str | None = None
    regex: str | None = None
    ebnf: str | None = None
    structural_tag: Any = None


# The request path names fields as SamplingParams does; errors name SGLang's.
_FIELD_NAMES = {
    **{f"sampling.{_SAMPLING_NAMES.get(name, name)}": f"sampling_params.{name}"
       for name in SamplingParamsBody.model_fields},
    "token_ids.ids": "input_ids",
}


class GenerateBody(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    text: str | list[str] | None = None
    input_ids: list[TokenId] | list[list[TokenId]] | None = None
    sampling_params: SamplingParamsBody = Field(default_factory=SamplingParamsBody)
    stream: bool = False
    rid: str | None = REQUEST_ID
    data_parallel_rank: Annotated[int, Field(ge=0, le=2**32 - 1)] | None = None
    return_logprob: bool = False
    lora_path: Any = None


@dataclass(frozen=True)
class WorkerState:
    """What the info and load routes report, read when asked."""

    model: ModelInfo
    served_model_name: str
    engine_loads: Callable[[], list[EngineLoad]]
    tensor_parallel_size: Callable[[], int]
    weight_version: Callable[[], str]


class SglangRoutes:
    def __init__(self, state: WorkerState, pipeline: Pipeline, tasks: tuple[str, ...],
                 authenticate: Callable[[Request], None],
                 body: Callable[[Request, type[Any]], Awaitable[Any]],
                 is_ready: Callable[[], bool]) -> None:
        self._state = state
        self._pipeline = pipeline
        self._tasks = tasks
        self._authenticate = authenticate
        self._body = body
        self._is_ready = is_ready

    def routes(self) -> list[Route]:
        return [
            Route("/generate", self.generate, methods=["POST"]),
            Route("/health_generate", self.health_generate, methods=["GET"]),
            Route("/v1/loads", self.loads, methods=["GET"]),
            *(Route(path, self.server_info, methods=["GET"])
              for path in ("/server_info", "/get_server_info")),
            *(Route(path, self.model_info, methods=["GET"])
              for path in ("/model_info", "/get_model_info")),
        ]

    async def server_info(self, request: Request) -> Response:
        return self._guarded(request, self._server_info)

    async def model_info(self, request: Request) -> Response:
        return self._guarded(request, self._model_info)

    async def loads(self, request: Request) -> Response:
        return self._guarded(request, self._loads)

    def _guarded(self, request: Request, answer: Callable[[], Json]) -> Response:
        try:
            self._authenticate(request)
        except RequestError as e:
            return error_response(e)
        return JSONResponse(answer())

    def _server_info(self) -> Json:
        model, state = self._state.model, self._state
        engines = state.engine_loads()
        return {
            "model_path": model.path or model.name,
            "tokenizer_path": model.path or model.name,
            "served_model_name": state.served_model_name,
            "context_length": model.max_model_len,
            "max_total_tokens": sum(_capacity_tokens(e) for e in engines),
            "tp_size": state.tensor_parallel_size() or 1,
            "dp_size": max(len(engines), 1),
            "pp_size": 1,
            "is_embedding": "generate" not in self._tasks,
            "disaggregation_mode": "null",
            "weight_version": state.weight_version(),
            "version": _version(),
            "backend": "corestream",
        }

    def _model_info(self) -> Json:
        model = self._state.model
        return {
            "model_path": model.path or model.name,
            "tokenizer_path": model.path or model.name,
            "is_generation": "generate" in self._tasks,
            "has_image_understanding": False,
            "has_audio_understanding": False,
            "architectures": list(model.architectures),
        }

    def _loads(self) -> Json:
        snapshots = []
        for e in self._state.engine_loads():
            capacity = _capacity_tokens(e)
            snapshots.append({
                "dp_rank": max(e.engine_index, 0),
                "num_running_reqs": e.num_running,
                "num_waiting_reqs": e.num_waiting,
                "num_total_reqs": e.num_running + e.num_waiting,
                "num_used_tokens": round(e.kv_cache_usage * capacity),
                "max_total_num_tokens": capacity,
                "token_usage": e.kv_cache_usage,
            })
        return {"timestamp": datetime.now(UTC).isoformat(), "dp_rank_count": len(snapshots),
                "loads": snapshots}

    async def health_generate(self, request: Request) -> Response:
        """One greedy token through the whole request path: the engines answer, not just
        the process (SGLang's meaning)."""
        try:
            self._authenticate(request)
        except RequestError as e:
            return error_response(e)
        if not self._is_ready() or self._pipeline.draining:
            return Response(status_code=503)
        probe = generate_pb2.GenerateStreamRequest(
            sampling=common_pb2.SamplingParams(max_tokens=1, temperature=0.0))
        probe.token_ids.ids.append(self._state.model.bos_token_id or 0)
        request_id = f"health-generate-{uuid.uuid4().hex}"
        try:
            async with asyncio.timeout(HEALTH_GENERATE_TIMEOUT_S):
                await collect_generate(request_id, self._pipeline.generate(
                    request_id, probe, http_calls.call_metadata(request)))
        except (RequestError, TimeoutError):
            return Response(status_code=503)
        return Response(status_code=200)

    async def generate(self, request: Request) -> Response:
        try:
            self._authenticate(request)
            body: GenerateBody = await self._body(request, GenerateBody)
            request_id = http_calls.request_id(request, body.rid)
            protos = generate_requests(body)
        except RequestError as e:
            return error_response(e, names=_FIELD_NAMES)
        metadata = http_calls.call_metadata(request)
        started = time.monotonic()
        if body.stream:
            proto = protos[0]
            proto.request_id = request_id
            chunks = self._pipeline.generate(request_id, proto, metadata)
            return await sse_response(_stream_events(chunks, request_id, started),
                                      request_id, _FIELD_NAMES)
        for i, proto in enumerate(protos):
            proto.request_id = request_id if len(protos) == 1 else f"{request_id}-{i}"

        async def whole() -> Any:
            results = await asyncio.gather(*(
                collect_generate(p.request_id, self._pipeline.generate(p.request_id, p,
                                                                       metadata))
                for p in protos))
            e2e = time.monotonic() - started
            answers = [_answer(c, result, e2e) for result in results
                       for c in result.completions]
            batched = _is_batch(body) or len(answers) > 1
            return answers if batched else answers[0]

        return await http_calls.whole(request, whole(), request_id, _FIELD_NAMES)


def generate_requests(body: GenerateBody) -> list[generate_pb2.GenerateStreamRequest]:
    """One request per prompt, in order, each with an empty request_id."""
    if body.return_logprob:
        raise invalid_argument("return_logprob", "return_logprob is not supported here; "
                                                 "/v1/completions returns logprobs")
    if body.lora_path:
        raise invalid_argument("lora_path", "LoRA adapters are not served")
    params = body.sampling_params
    if params.structural_tag is not None:
        raise invalid_argument("sampling_params.structural_tag",
                               "structural_tag is not supported")
    if (body.text is None) == (body.input_ids is None):
        raise invalid_argument("text", "give exactly one of text and input_ids")
    prompts: list[str | list[int]]
    if isinstance(body.text, str):
        prompts = [body.text]
    elif body.text is not None:
        prompts = list(body.text)
    elif body.input_ids and isinstance(body.input_ids[0], list):
        prompts = [list(ids) for ids in body.input_ids]  # type: ignore[union-attr]
    else:
        prompts = [list(body.input_ids or [])]  # type: ignore[arg-type]
    if not prompts:
        raise invalid_argument("text" if body.text is not None else "input_ids",
                               "the batch is empty")
    if body.stream and len(prompts) > 1:
        raise invalid_argument("stream", "stream takes one prompt, not a batch")
    sampling = _sampling(params)
    requests = []
    for prompt in prompts:
        request = generate_pb2.GenerateStreamRequest(sampling=sampling)
        if isinstance(prompt, str):
            request.text = prompt
        else:
            request.token_ids.ids.extend(prompt)
        if params.skip_special_tokens is not None:
            request.skip_special_tokens = params.skip_special_tokens
        if body.data_parallel_rank is not None:
            request.data_parallel_rank = body.data_parallel_rank
        requests.append(request)
    return requests


def _sampling(params: SamplingParamsBody) -> common_pb2.SamplingParams:
    constraints = [(name, value) for name in ("json_schema", "regex", "ebnf")
                   if (value := getattr(params, name)) is not None]
    if len(constraints) > 1:
        raise invalid_argument(f"sampling_params.{constraints[1][0]}",
                               "give at most one of json_schema, regex and ebnf")
    sampling = common_pb2.SamplingParams(
        stop=[params.stop] if isinstance(params.stop, str) else params.stop or [],
        stop_token_ids=params.stop_token_ids or [],
        ignore_eos=params.ignore_eos,
        include_stop_str_in_output=params.no_stop_trim,
    )
    for key, bias in (params.logit_bias or {}).items():
        # Not str.isdigit, which takes digits int() refuses ("²"); the key must fit the
        # proto's uint32 too.
        if not _TOKEN_ID_KEY.fullmatch(key) or int(key) >= 2**32:
            raise invalid_argument("sampling_params.logit_bias",
                                   f"logit_bias keys are token ids, got {key!r}")
        sampling.logit_bias[int(key)] = bias
    max_new_tokens = (DEFAULT_MAX_NEW_TOKENS if params.max_new_tokens is None
                      else params.max_new_tokens)
    optional = {"max_tokens": max_new_tokens, "min_tokens": params.min_new_tokens,
                "temperature": params.temperature, "top_p": params.top_p,
                "top_k": params.top_k, "min_p": params.min_p,
                "frequency_penalty": params.frequency_penalty,
                "presence_penalty": params.presence_penalty,
                "repetition_penalty": params.repetition_penalty, "n": params.n,
                "seed": params.sampling_seed}
    for name, value in optional.items():
        if value is not None:
            setattr(sampling, name, value)
    for name, value in constraints:
        setattr(sampling, _SAMPLING_NAMES.get(name, name), value)
    return sampling


def _is_batch(body: GenerateBody) -> bool:
    return isinstance(body.text, list) or bool(
        body.input_ids and isinstance(body.input_ids[0], list))


def _answer(completion: generate_pb2.Completion, result: generate_pb2.GenerateResponse,
            e2e_s: float) -> Json:
    return {"text": completion.text, "output_ids": list(completion.token_ids),
            "meta_info": _meta(result.request_id, completion.finish_reason,
                               completion.WhichOneof("matched_stop"), completion,
                               len(completion.token_ids), result.usage,
                               completion.weight_version, e2e_s)}


def _meta(request_id: str, reason: int, stop_field: str | None, stop_source: Any,
          num_tokens: int, usage: common_pb2.Usage | None, weight_version: str,
          e2e_s: float | None) -> Json:
    meta: Json = {"id": request_id, "finish_reason": None, "completion_tokens": num_tokens,
                  "weight_version": weight_version}
    if usage is not None:
        meta["prompt_tokens"] = usage.prompt_tokens
        meta["cached_tokens"] = usage.cached_tokens
    if reason:
        kind = _FINISH_TYPES.get(reason, "abort")
        finish: Json = {"type": kind}
        if kind == "length":
            finish["length"] = num_tokens
        elif kind == "stop":
            finish["matched"] = (getattr(stop_source, stop_field)
                                 if stop_field is not None else None)
        meta["finish_reason"] = finish
    if e2e_s is not None:
        meta["e2e_latency"] = e2e_s
    return meta


async def _stream_events(chunks: AsyncIterator[generate_pb2.GenerateStreamResponse],
                         request_id: str, started: float) -> AsyncIterator[Json]:
    """SGLang's stream: each event holds a sample's text and tokens so far."""
    texts: dict[int, list[str]] = {}
    ids: dict[int, list[int]] = {}
    prompt_usage: common_pb2.Usage | None = None
    async for chunk in chunks:
        text = texts.setdefault(chunk.index, [])
        text.append(chunk.text)
        tokens = ids.setdefault(chunk.index, [])
        tokens.extend(chunk.token_ids)
        if chunk.HasField("usage"):
            prompt_usage = chunk.usage
        if not (chunk.text or chunk.token_ids or chunk.finish_reason):
            continue
        done = bool(chunk.finish_reason)
        meta = _meta(request_id, chunk.finish_reason, chunk.WhichOneof("matched_stop"), chunk,
                     len(tokens), prompt_usage, chunk.weight_version,
                     time.monotonic() - started if done else None)
        yield {"text": "".join(text), "output_ids": list(tokens), "meta_info": meta,
               "index": chunk.index}


def _capacity_tokens(engine: EngineLoad) -> int:
    capacity = engine.capacity
    return capacity.num_blocks * capacity.block_size if capacity is not None else 0


def _version() -> str:
    try:
        return metadata.version("corestream")
    except metadata.PackageNotFoundError:
        return "unknown"
