"""The pooling routes of the HTTP door, in OpenAI's and vLLM's shapes, onto the same
pooling operations PoolingService calls (pooling/operations.py: validation, prompts,
limits, routing, telemetry):

    POST /v1/embeddings                OpenAI's: `input` a string, strings, token ids or
                                       lists of token ids; `dimensions`; `encoding_format`
                                       float or base64 (little-endian float32, as OpenAI)
    POST /v1/score, /score             vLLM's: `text_1` scored against `text_2`, one
                                       against one, one against each, or pairwise (N:N)
    POST /v1/rerank, /rerank, /v2/rerank   Jina's and Cohere's shape, as vLLM serves it:
                                       `query`, `documents`, `top_n` (0: all), best first
    POST /classify, /v1/classify       vLLM's: `input` as for embeddings

Besides those, every route takes `model` (absent: the served one, as vLLM), `user`
(ignored), `request_id`, our `truncate` (cut inputs longer than the context instead of
refusing them) and vLLM's `truncate_prompt_tokens`, of which only the values that mean
"cut to the context" are served: -1, or any value at least the context length (a
shorter cut is refused, not ignored). Embeddings also take `normalize` (ours) or vLLM's
`use_activation` (its name for the same), and `prompt_name` (a sentence-transformers
prompt, as on gRPC); classification takes `use_activation` (false: raw logits).

Errors name the body's own fields (`input[2]`, `text_2`, `documents[0]`); a task the
model does not serve is 400, naming the task.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import time
from collections.abc import Awaitable, Callable, Iterable, Iterator
from typing import Annotated, Any, Literal, Protocol, TypeVar

import numpy as np
from pydantic import BaseModel, ConfigDict, Field
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from services.frontend.errors import RequestError, invalid_argument
from services.frontend.openai_api import http_calls
from services.frontend.openai_api.http_errors import error_response
from services.frontend.openai_api.schemas import REQUEST_ID, Int32, TokenId
from services.frontend.pooling.operations import Input, PoolingOperations, Scored

Json = dict[str, Any]
T = TypeVar("T")


class _PoolingBody(BaseModel):
    # Unknown fields are ignored, as the generating routes do (schemas.py).
    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    user: str | None = None
    request_id: str | None = REQUEST_ID
    truncate: bool = False
    truncate_prompt_tokens: Annotated[int, Field(ge=-1)] | None = None


class EmbeddingBody(_PoolingBody):
    input: str | list[str] | list[TokenId] | list[list[TokenId]]
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: Int32 | None = None
    normalize: bool | None = None
    use_activation: bool | None = None
    prompt_name: str | None = None


class ClassifyBody(_PoolingBody):
    input: str | list[str] | list[TokenId] | list[list[TokenId]]
    use_activation: bool | None = None


class _ScoringBody(_PoolingBody):
    # Declared to refuse false: scores come out of the model's sigmoid only.
    use_activation: bool | None = None


class ScoreBody(_ScoringBody):
    text_1: str | list[str]
    text_2: str | list[str]


class RerankBody(_ScoringBody):
    query: str
    documents: str | list[str]
    top_n: Annotated[int, Field(ge=0)] = 0


B = TypeVar("B", bound=_PoolingBody)


class BodyReader(Protocol):
    """The app's body reader: size limit, JSON, schema, `model` check."""

    def __call__(self, request: Request, schema: type[T]) -> Awaitable[T]: ...


Handler = Callable[[Request], Awaitable[Response]]


class PoolingRoutes:
    def __init__(self, operations: PoolingOperations, model: str, max_model_len: int,
                 authenticate: Callable[[Request], None], read_body: BodyReader) -> None:
        self._ops = operations
        self._model = model
        self._max_model_len = max_model_len
        self._authenticate = authenticate
        self._read_body = read_body

    def routes(self) -> list[Route]:
        paths: list[tuple[str, Handler]] = [
            ("/v1/embeddings", self.embeddings),
            ("/v1/score", self.score), ("/score", self.score),
            ("/v1/rerank", self.rerank), ("/rerank", self.rerank), ("/v2/rerank", self.rerank),
            ("/classify", self.classify), ("/v1/classify", self.classify),
        ]
        return [Route(path, handler, methods=["POST"]) for path, handler in paths]

    async def embeddings(self, request: Request) -> Response:
        try:
            body, request_id = await self._start(request, EmbeddingBody)
            inputs, one = _inputs(body.input)
            normalize = _normalize(body)
            truncate = self._truncate(body)
        except RequestError as e:
            return error_response(e)

        async def work() -> Json:
            with _as_one("input", one):
                done = await self._ops.embed(
                    request_id, inputs, http_calls.call_metadata(request), field="input",
                    dimensions=body.dimensions, normalize=normalize, truncate=truncate,
                    prompt_name=body.prompt_name)
            data = [{"object": "embedding", "index": i,
                     "embedding": _encoded(r.values, body.encoding_format)}
                    for i, r in enumerate(done.results)]
            return self._listed(f"embd-{request_id}", data, done.num_prompt_tokens,
                                done.weight_version)

        return await http_calls.whole(request, work(), request_id)

    async def classify(self, request: Request) -> Response:
        try:
            body, request_id = await self._start(request, ClassifyBody)
            inputs, one = _inputs(body.input)
            truncate = self._truncate(body)
        except RequestError as e:
            return error_response(e)

        async def work() -> Json:
            with _as_one("input", one):
                done = await self._ops.classify(
                    request_id, inputs, http_calls.call_metadata(request), field="input",
                    truncate=truncate, activation=body.use_activation)
            labels = self._ops.pooler.labels if self._ops.pooler is not None else ()
            data = [{"index": i, "label": labels[int(r.values.argmax())] if labels else None,
                     "probs": r.values.tolist(), "num_classes": int(r.values.size)}
                    for i, r in enumerate(done.results)]
            return self._listed(f"classify-{request_id}", data, done.num_prompt_tokens,
                                done.weight_version)

        return await http_calls.whole(request, work(), request_id)

    async def score(self, request: Request) -> Response:
        try:
            body, request_id = await self._start(request, ScoreBody)
            truncate = self._scoring_truncate(body)
            pairs = self._pairs(body)
        except RequestError as e:
            return error_response(e)
        metadata = http_calls.call_metadata(request)

        async def work() -> Json:
            if pairs is None:  # one text_1 against each text_2: one call
                text_1 = body.text_1 if isinstance(body.text_1, str) else body.text_1[0]
                query_field = "text_1" if isinstance(body.text_1, str) else "text_1[0]"
                one = isinstance(body.text_2, str)
                with _as_one("text_2", one):
                    done = await self._ops.score(
                        request_id, text_1, [body.text_2] if one else body.text_2, metadata,
                        query_field=query_field, field="text_2", truncate=truncate)
                scored = [done]
            else:  # pairwise: one call per pair, side by side
                scored = await _all(self._scored_pair(f"{request_id}-p{i}", pair, i, metadata,
                                                      truncate)
                                    for i, pair in enumerate(pairs))
            scores = [s for done in scored for s in done.scores]
            data = [{"index": i, "object": "score", "score": s} for i, s in enumerate(scores)]
            return self._listed(f"score-{request_id}", data,
                                sum(done.num_prompt_tokens for done in scored),
                                next((d.weight_version for d in reversed(scored)
                                      if d.weight_version), ""))

        return await http_calls.whole(request, work(), request_id)

    async def rerank(self, request: Request) -> Response:
        try:
            body, request_id = await self._start(request, RerankBody)
            truncate = self._scoring_truncate(body)
        except RequestError as e:
            return error_response(e)
        one = isinstance(body.documents, str)
        documents = [body.documents] if isinstance(body.documents, str) else body.documents

        async def work() -> Json:
            with _as_one("documents", one):
                done = await self._ops.score(
                    request_id, body.query, documents, http_calls.call_metadata(request),
                    query_field="query", field="documents", truncate=truncate)
            results = sorted(({"index": i, "document": {"text": documents[i]},
                               "relevance_score": s} for i, s in enumerate(done.scores)),
                             key=lambda r: -r["relevance_score"])
            usage = {"prompt_tokens": done.num_prompt_tokens,
                     "total_tokens": done.num_prompt_tokens}
            return _with_version({"id": f"rerank-{request_id}", "model": self._model,
                                  "usage": usage, "results": results[:body.top_n or None]},
                                 done.weight_version)

        return await http_calls.whole(request, work(), request_id)

    # ---- helpers -------------------------------------------------------------------

    async def _start(self, request: Request, schema: type[B]) -> tuple[B, str]:
        self._authenticate(request)
        body = await self._read_body(request, schema)
        return body, http_calls.request_id(request, body.request_id)

    def _truncate(self, body: _PoolingBody) -> bool:
        cut = body.truncate_prompt_tokens
        if cut is None or cut == -1 or cut >= self._max_model_len:
            return body.truncate or cut is not None
        raise invalid_argument("truncate_prompt_tokens", (
            f"truncate_prompt_tokens {cut} is not served: inputs are cut to the model's "
            f"context ({self._max_model_len} tokens) with -1 (or truncate: true), not shorter"))

    def _scoring_truncate(self, body: _ScoringBody) -> bool:
        if body.use_activation is False:
            raise invalid_argument("use_activation", "use_activation false (raw logits) is "
                                   "not served for scores; /classify returns logits")
        return self._truncate(body)

    def _pairs(self, body: ScoreBody) -> list[tuple[str, str]] | None:
        """The (text_1, text_2) pairs when they go pairwise (N:N); None for one text_1
        against each text_2 (1:1 and 1:N), as vLLM pairs them."""
        if isinstance(body.text_1, str) or len(body.text_1) == 1:
            return None
        if not body.text_1:
            raise invalid_argument("text_1", "text_1 is empty: give at least one text")
        texts_2 = [body.text_2] if isinstance(body.text_2, str) else body.text_2
        if len(texts_2) != len(body.text_1):
            raise invalid_argument("text_2", (
                f"text_1 has {len(body.text_1)} texts and text_2 {len(texts_2)}: give one "
                "text_1, or as many as text_2 (pairs are scored 1:1, 1:N or N:N)"))
        if len(texts_2) > self._ops.max_inputs:
            raise invalid_argument("text_2", (
                f"text_2 has {len(texts_2)} inputs, at most {self._ops.max_inputs} are "
                "allowed in one call (the frontend's --max-pooling-inputs)"))
        return list(zip(body.text_1, texts_2, strict=True))

    async def _scored_pair(self, request_id: str, pair: tuple[str, str], i: int,
                           metadata: dict[str, str], truncate: bool) -> Scored:
        with _renamed("text_2[0]", f"text_2[{i}]"):
            return await self._ops.score(request_id, pair[0], [pair[1]], metadata,
                                         query_field=f"text_1[{i}]", field="text_2",
                                         truncate=truncate)

    def _listed(self, id: str, data: list[Json], num_prompt_tokens: int,
                weight_version: str) -> Json:
        """vLLM's list envelope (OpenAI's, for embeddings, plus `id` and `created`)."""
        return _with_version({
            "id": id, "object": "list", "created": int(time.time()), "model": self._model,
            "data": data,
            "usage": {"prompt_tokens": num_prompt_tokens, "total_tokens": num_prompt_tokens},
        }, weight_version)


def _inputs(value: str | list[str] | list[int] | list[list[int]]) -> tuple[list[Input], bool]:
    """The body's `input` as a list of inputs, and whether it gave one (a string or one
    list of token ids) rather than a list of them."""
    if isinstance(value, str):
        return [value], True
    if value and all(isinstance(item, int) for item in value):
        return [value], True  # type: ignore[list-item]
    return list(value), False  # type: ignore[arg-type]


def _normalize(body: EmbeddingBody) -> bool | None:
    given = {v for v in (body.normalize, body.use_activation) if v is not None}
    if len(given) > 1:
        raise invalid_argument("use_activation", "use_activation (vLLM's name for "
                               "normalize) and normalize disagree: give one of them")
    return given.pop() if given else None


def _encoded(values: np.ndarray, encoding_format: str) -> list[Any] | str:
    if encoding_format == "base64":
        # OpenAI's: the float32 values' bytes, little-endian (rows one after another).
        return base64.b64encode(values.astype("<f4").tobytes()).decode("ascii")
    return values.tolist()


def _with_version(body: Json, weight_version: str) -> Json:
    """`metadata.weight_version`, as the generating routes report it (responses.py)."""
    if weight_version:
        body["metadata"] = {"weight_version": weight_version}
    return body


def _as_one(field: str, one: bool) -> contextlib.AbstractContextManager[None]:
    """Errors about input 0 name `field` itself where the body gave one input, not a
    list (`input[0][3]` is `input[3]`)."""
    return _renamed(f"{field}[0]", field) if one else contextlib.nullcontext()


@contextlib.contextmanager
def _renamed(old: str, new: str) -> Iterator[None]:
    """A RequestError naming the field `old` (or a part of it, `old[3]`) names `new`:
    the operations number every input, and a body that gave one input, or one pair of
    several, names it otherwise."""
    try:
        yield
    except RequestError as e:
        if old == new or not (e.field == old or e.field.startswith(f"{old}[")):
            raise
        raise RequestError(e.code, e.message.replace(old, new), new + e.field[len(old):],
                           e.reason, e.retry_after_s) from None


async def _all(calls: Iterable[Awaitable[Scored]]) -> list[Scored]:
    """The results of calls run side by side; the first failure cancels the rest."""
    tasks = [asyncio.ensure_future(call) for call in calls]
    try:
        return list(await asyncio.gather(*tasks))
    finally:
        for task in tasks:
            task.cancel()

