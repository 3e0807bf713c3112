"""The pooling operations every door calls (PoolingService, the HTTP API's
/v1/embeddings, /v1/score, /v1/rerank, /classify): validation, prompts, tokenization
and length limits, then the run (runner.py), then the results as the task wants them.

Inputs come as texts or token ids (`Input`); a door names its own field for them
(`inputs` on gRPC, `input` on HTTP), and errors name `field[i]`. A model serves the
tasks its `Pooler` lists: another task is FAILED_PRECONDITION, and a generative model
(no pooler) serves none of them.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import grpc
import numpy as np

from services.common.model_info import ModelInfo
from services.common.pooling import (
    Pooler,
    PoolingParams,
    PoolingTask,
    PoolingType,
    TaskMismatch,
    resolve_params,
)
from services.frontend.config import FrontendConfig
from services.frontend.errors import RequestError, invalid_argument
from services.frontend.pipeline import Pipeline
from services.frontend.pooling.runner import Pooled, PoolingCall, PoolingRunner
from services.frontend.tokenizer import TextTokenizer

Input = str | Sequence[int]


@dataclass(frozen=True, slots=True)
class Embedded:
    """One call's results, in input order, and what it cost."""

    results: list[Pooled]
    num_prompt_tokens: int

    @property
    def weight_version(self) -> str:
        return self.results[0].weight_version if self.results else ""


@dataclass(frozen=True, slots=True)
class Scored:
    scores: list[float]
    num_prompt_tokens: int
    weight_version: str


class PoolingOperations:
    def __init__(self, config: FrontendConfig, pipeline: Pipeline, tokenizer: TextTokenizer,
                 model: ModelInfo, pooler: Pooler | None, runner: PoolingRunner) -> None:
        self._config = config
        self._pipeline = pipeline
        self._tokenizer = tokenizer
        self._model = model
        self.pooler = pooler
        self._runner = runner
        self.max_inputs = config.max_pooling_inputs

    @property
    def model_name(self) -> str:
        return self._config.served_model_name or self._model.name

    async def embed(self, request_id: str, inputs: Sequence[Input], metadata: Mapping[str, str],
                    *, field: str = "inputs", dimensions: int | None = None,
                    pooling_type: PoolingType | None = None, normalize: bool | None = None,
                    truncate: bool = False, prompt_name: str | None = None) -> Embedded:
        params = self._params(PoolingParams(PoolingTask.EMBED, pooling_type, normalize,
                                            dimensions), "embed")
        prompt = self._prompt(prompt_name)
        return await self._run(request_id, inputs, params, metadata, field, truncate,
                               prompt, "embeddings")

    async def classify(self, request_id: str, inputs: Sequence[Input],
                       metadata: Mapping[str, str], *, field: str = "inputs",
                       truncate: bool = False, activation: bool | None = None) -> Embedded:
        params = self._params(PoolingParams(PoolingTask.CLASSIFY, activation=activation),
                              "classify")
        return await self._run(request_id, inputs, params, metadata, field, truncate, "",
                               "classify")

    async def score(self, request_id: str, query: Input, documents: Sequence[Input],
                    metadata: Mapping[str, str], *, query_field: str = "query",
                    field: str = "documents", truncate: bool = False) -> Scored:
        """A cross-encoder's relevance of each (query, document) pair (its one output,
        after its sigmoid), or an embedder's cosine similarity of the two embeddings."""
        pooler = self._require("score")
        self._check_inputs(documents, field)
        self._check_input(query, query_field)
        if pooler.task is PoolingTask.EMBED:
            # One run for both, each input named as the caller gave it.
            params = self._params(PoolingParams(PoolingTask.EMBED), "embed")
            names = [query_field, *(f"{field}[{i}]" for i in range(len(documents)))]
            both = await self._run(request_id, [query, *documents], params, metadata, names,
                                   truncate, self._prompt(None), "embeddings")
            vectors = [r.values.astype(np.float64) for r in both.results]
            return Scored([_cosine(vectors[0], v) for v in vectors[1:]],
                          both.num_prompt_tokens, both.weight_version)
        if pooler.num_labels != 1:
            raise RequestError(grpc.StatusCode.FAILED_PRECONDITION, (
                f"score takes a cross-encoder (a classifier with one output) or an "
                f"embedder; this model classifies into {pooler.num_labels} labels"))
        pairs = [await self._pair(query, doc, f"{field}[{i}]")
                 for i, doc in enumerate(documents)]
        scored = await self.classify(request_id, pairs, metadata, field=field,
                                     truncate=truncate)
        return Scored([float(r.values[0]) for r in scored.results],
                      scored.num_prompt_tokens, scored.weight_version)

    # ---- the path ------------------------------------------------------------------

    async def _run(self, request_id: str, inputs: Sequence[Input], params: PoolingParams,
                   metadata: Mapping[str, str], field: str | list[str], truncate: bool,
                   prompt: str, operation: str) -> Embedded:
        """`field`: the inputs' field, checked here; or each input's name, checked by
        the caller."""
        if isinstance(field, str):
            self._check_inputs(inputs, field)
            names = [f"{field}[{i}]" for i in range(len(inputs))]
        else:
            names = field
        async with self._pipeline.request(request_id, metadata, operation) as telemetry:
            with telemetry.phase("tokenize"):
                token_ids = [await self._tokens(item, name, prompt, truncate)
                             for item, name in zip(inputs, names, strict=True)]
            call = PoolingCall(request_id, token_ids, params,
                               trace_headers=telemetry.trace_headers())
            results = await self._runner.run(call)
        return Embedded(results, sum(len(ids) for ids in token_ids))

    def _params(self, params: PoolingParams, task: str) -> PoolingParams:
        self._pipeline.check_accepting()
        pooler = self._require(task)
        try:
            resolve_params(params, pooler)  # the engine completes them the same way
        except TaskMismatch as exc:
            raise RequestError(grpc.StatusCode.FAILED_PRECONDITION, str(exc)) from None
        except ValueError as exc:
            name = str(exc).split(" ", 1)[0].rstrip(":")
            raise invalid_argument(name, str(exc)) from None
        return params

    def _require(self, task: str) -> Pooler:
        pooler = self.pooler
        if pooler is None:
            raise RequestError(grpc.StatusCode.FAILED_PRECONDITION, (
                f"{task} needs a pooling model; {self._model.name} generates text (serve "
                "an embedding or classification model, or this one with --runner pooling)"))
        if task not in pooler.tasks:
            raise RequestError(grpc.StatusCode.FAILED_PRECONDITION,
                               f"this model serves {' and '.join(pooler.tasks)}, not {task}")
        return pooler

    def _prompt(self, name: str | None) -> str:
        prompts = self.pooler.prompts if self.pooler is not None else {}
        if name is None:
            default = self.pooler.default_prompt_name if self.pooler is not None else None
            return prompts.get(default, "") if default else ""
        if name not in prompts:
            known = ", ".join(sorted(prompts)) or "none"
            raise invalid_argument("prompt_name", f"prompt_name {name!r} is not one of the "
                                   f"model's prompts ({known})")
        return prompts[name]

    def _check_inputs(self, inputs: Sequence[Input], field: str) -> None:
        if not inputs:
            raise invalid_argument(field, f"{field} is empty: give at least one input")
        if len(inputs) > self.max_inputs:
            raise invalid_argument(field, (
                f"{field} has {len(inputs)} inputs, at most {self.max_inputs} are allowed "
                "in one call (the frontend's --max-pooling-inputs)"))
        for i, item in enumerate(inputs):
            self._check_input(item, f"{field}[{i}]")

    def _check_input(self, item: Input, field: str) -> None:
        if isinstance(item, str):
            if not item:
                raise invalid_argument(field, f"{field} is an empty string")
            return
        if not item:
            raise invalid_argument(field, f"{field} has no token ids")
        vocab = self._model.vocab_size
        for j, token_id in enumerate(item):
            if not 0 <= token_id < vocab:
                raise invalid_argument(field, (f"{field}[{j}] = {token_id} is out of the "
                                               f"vocabulary (token ids must be < {vocab})"))

    async def _tokens(self, item: Input, field: str, prompt: str, truncate: bool) -> list[int]:
        ids = (await self._pipeline.encode(prompt + item, add_special_tokens=True)
               if isinstance(item, str) else list(item))
        return self._fit(ids, field, truncate)

    async def _pair(self, query: Input, document: Input, field: str) -> list[int]:
        """A cross-encoder's input: the tokenizer's pair template for two texts, else the
        two token id lists one after the other."""
        if isinstance(query, str) and isinstance(document, str):
            return self._tokenizer.encode_pair(query, document)
        parts = [self._tokenizer.encode(x) if isinstance(x, str) else list(x)
                 for x in (query, document)]
        return parts[0] + parts[1]

    def _fit(self, ids: list[int], field: str, truncate: bool) -> list[int]:
        limit = self._model.max_model_len
        if self._config.max_prompt_tokens:
            limit = min(limit, self._config.max_prompt_tokens)
        if len(ids) <= limit:
            return ids
        if truncate:
            return ids[:limit]
        raise invalid_argument(field, (
            f"{field} has {len(ids)} tokens, more than the {limit} the model takes; "
            "shorten it or set truncate"))


def _cosine(a: np.ndarray, b: np.ndarray) -> float:
    norm = float(np.linalg.norm(a) * np.linalg.norm(b))
    return float(np.dot(a, b)) / norm if norm and math.isfinite(norm) else 0.0
