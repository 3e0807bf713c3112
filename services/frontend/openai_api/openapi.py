"""The HTTP door's OpenAPI 3.1 document (`GET /openapi.json`), built from the pydantic
bodies the routes validate with and from one table of what each route answers.

Only the routes the app serves are described (the pooling routes exist only for a
pooling model): `document` walks the app's routes and looks each up in OPERATIONS; a
route missing there is a bug that tests/unit/frontend/openai_api/test_openapi.py
catches. Every failure status carries the OpenAI error body
(`{"error": {"message", "type", "param", "code"}}`, http_errors.py), and every response
an `X-Request-Id` (RequestIds). Statuses listed are those a route can answer, so that a
client (or a fuzzer) can tell a documented refusal from a bug.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from importlib import metadata
from typing import Any

from pydantic import BaseModel
from pydantic.json_schema import models_json_schema
from starlette.routing import BaseRoute, Route

from services.frontend.openai_api import rl_bodies
from services.frontend.openai_api.pooling_routes import (
    ClassifyBody,
    EmbeddingBody,
    RerankBody,
    ScoreBody,
)
from services.frontend.openai_api.schemas import ChatCompletionBody, CompletionBody
from services.frontend.openai_api.sglang_routes import GenerateBody

Json = dict[str, Any]

_REASONS = {
    400: "The request is invalid; `error.param` names the field at fault.",
    401: "No valid `Authorization: Bearer <key>` (with --api-key-file or "
         "--admin-api-key-file).",
    404: "The body's `model` is not the served one.",
    408: "The request body did not arrive within --http-body-timeout-s.",
    409: "A request with this id is already running.",
    413: "The request body is larger than its limit (--max-message-bytes).",
    429: "The engines are overloaded; retry after `Retry-After` seconds.",
    503: "The server is draining, has no engine ready, or an engine failed.",
    504: "The request did not finish within the server's time limit.",
}
# What every route onto the request path may answer besides 200.
_REQUEST_PATH = (400, 401, 404, 408, 409, 413, 429, 503, 504)
# The RL routes: their own checks, and the engines' answers (rl_routes._checked).
_ADMIN = (400, 401, 408, 413, 503, 504)


@dataclass(frozen=True)
class Operation:
    summary: str
    body: type[BaseModel] | None = None
    statuses: Sequence[int] = ()
    """Failure statuses besides the success; each with the error body."""
    auth: bool = True
    """Takes an API (or admin) key when the server has keys."""
    ok: str = "json"
    """The success: json, json+sse (an event stream when `stream` is true), text, none."""
    ok_status: int = 200
    query: Sequence[Json] = field(default_factory=tuple)
    health: bool = False
    """/health-like: a bodiless 200 or 503."""


def _query(name: str, schema: Json, description: str) -> Json:
    return {"name": name, "in": "query", "required": False, "schema": schema,
            "description": description}


OPERATIONS: dict[tuple[str, str], Operation] = {
    ("GET", "/v1/models"): Operation("The served model.", statuses=(401,)),
    ("POST", "/v1/completions"): Operation(
        "OpenAI's completions (vLLM's extra fields too).", CompletionBody, _REQUEST_PATH,
        ok="json+sse"),
    ("POST", "/v1/chat/completions"): Operation(
        "OpenAI's chat completions (vLLM's extra fields too).", ChatCompletionBody,
        _REQUEST_PATH, ok="json+sse"),
    ("GET", "/health"): Operation("200 when ready, 503 while starting or draining.",
                                  auth=False, health=True),
    ("GET", "/metrics"): Operation("The frontend's Prometheus metrics.", auth=False, ok="text"),
    ("GET", "/openapi.json"): Operation("This document.", auth=False),
    # Pooling models only.
    ("POST", "/v1/embeddings"): Operation("OpenAI's embeddings.", EmbeddingBody, _REQUEST_PATH),
    **{("POST", path): Operation("vLLM's score.", ScoreBody, _REQUEST_PATH)
       for path in ("/v1/score", "/score")},
    **{("POST", path): Operation("Jina's and Cohere's rerank.", RerankBody, _REQUEST_PATH)
       for path in ("/v1/rerank", "/rerank", "/v2/rerank")},
    **{("POST", path): Operation("vLLM's classify.", ClassifyBody, _REQUEST_PATH)
       for path in ("/classify", "/v1/classify")},
    # vLLM's RL routes (admin keys where there are any).
    ("POST", "/pause"): Operation("Pause generation on every engine.", statuses=_ADMIN, query=(
        _query("mode", {"type": "string", "enum": ["abort", "wait", "keep"]},
               "What happens to running requests (default abort)."),
        _query("clear_cache", {"type": "boolean"}, "Drop the prefix cache (default true)."),
        _query("timeout_s", {"type": "number", "exclusiveMinimum": 0, "maximum": 600},
               "mode wait: the longest wait for running requests to end."))),
    ("POST", "/resume"): Operation("Resume generation.", statuses=_ADMIN),
    ("GET", "/is_paused"): Operation("Whether every engine is paused.", statuses=_ADMIN),
    ("POST", "/init_weight_transfer_engine"): Operation(
        "Every engine joins the trainer's weight-transfer group.",
        rl_bodies.InitWeightTransferBody, _ADMIN),
    ("POST", "/start_weight_update"): Operation(
        "Begin a weight update.", rl_bodies.StartWeightUpdateBody, _ADMIN),
    ("POST", "/update_weights"): Operation(
        "Stage weights (broadcast, or a shared-memory file).", rl_bodies.UpdateWeightsBody,
        _ADMIN),
    ("POST", "/finish_weight_update"): Operation(
        "Switch every engine to the staged weights at once.",
        rl_bodies.FinishWeightUpdateBody, _ADMIN),
    ("POST", "/abort_weight_update"): Operation("Drop the staged weights.", statuses=_ADMIN),
    ("POST", "/update_weights_from_disk"): Operation(
        "Load new weights from a checkpoint (SGLang's).",
        rl_bodies.UpdateWeightsFromDiskBody, _ADMIN),
    ("GET", "/weight_info"): Operation("The weight version of every engine.", statuses=_ADMIN),
    ("POST", "/sleep"): Operation("Free the engines' memory.", statuses=_ADMIN, query=(
        _query("level", {"type": "integer", "enum": [1, 2]},
               "1: offload weights, drop the KV cache; 2: drop both (default 1)."),)),
    ("POST", "/wake_up"): Operation("Restore what /sleep freed.", statuses=_ADMIN, query=(
        {**_query("tags", {"type": "array",
                           "items": {"type": "string", "enum": ["weights", "kv_cache"]}},
                  "What to restore (none: both)."), "style": "form", "explode": True},)),
    ("GET", "/is_sleeping"): Operation("Whether every engine sleeps.", statuses=_ADMIN),
    # SGLang's worker routes.
    ("POST", "/generate"): Operation("SGLang's generate.", GenerateBody, _REQUEST_PATH,
                                     ok="json+sse"),
    ("GET", "/health_generate"): Operation(
        "200 once a one-token generation succeeds.", statuses=(401,), health=True),
    ("GET", "/v1/loads"): Operation("Each engine's load (SGLang's).", statuses=(401,)),
    **{("GET", path): Operation("What SGLang's gateway reads of a worker.", statuses=(401,))
       for path in ("/server_info", "/get_server_info", "/model_info", "/get_model_info")},
}


def served(routes: Iterable[BaseRoute]) -> list[tuple[str, str]]:
    """(method, path) of every route, HEAD (Starlette's, with each GET) left out."""
    return [(method, route.path) for route in routes if isinstance(route, Route)
            for method in sorted(route.methods or ()) if method != "HEAD"]


def document(routes: Iterable[BaseRoute], auth: bool, model_names: Sequence[str]) -> Json:
    """The OpenAPI document of `routes`; `auth`: the server has keys; `model_names`: the
    names a body's `model` may give (any other is a 404)."""
    operations = {key: OPERATIONS[key] for key in served(routes)}
    bodies = sorted({op.body for op in operations.values() if op.body is not None},
                    key=lambda model: model.__name__)
    refs, top = models_json_schema([(model, "validation") for model in bodies],
                                   ref_template="#/components/schemas/{model}")
    schemas: Json = {**top.get("$defs", {}), "Error": _ERROR_SCHEMA}
    for schema in schemas.values():
        _name_the_models(schema, model_names)
    paths: Json = {}
    for (method, path), op in operations.items():
        body_ref = refs[(op.body, "validation")] if op.body is not None else None
        paths.setdefault(path, {})[method.lower()] = _operation(op, body_ref, auth)
    doc: Json = {
        "openapi": "3.1.0",
        "info": {"title": "corestream HTTP API", "version": _version(),
                 "description": "OpenAI-compatible completions and chat, vLLM's and "
                                "SGLang's routes, on corestream's request path."},
        "paths": paths,
        "components": {"schemas": schemas,
                       "headers": {"X-Request-Id": {
                           "description": "The request's id (the client's, or a new one).",
                           "schema": {"type": "string"}}}},
    }
    if auth:
        doc["components"]["securitySchemes"] = {"bearer": {"type": "http", "scheme": "bearer"}}
    return doc


def _name_the_models(schema: Json, names: Sequence[str]) -> None:
    """`model` as the served names: pydantic knows it only as a string."""
    model = schema.get("properties", {}).get("model")
    if model is None:
        return
    served = {"type": "string", "enum": list(names)}
    optional = {"type": "null"} in model.get("anyOf", ())
    schema["properties"]["model"] = {
        "title": model.get("title", "Model"),
        **({"anyOf": [served, {"type": "null"}], "default": None} if optional else served)}


_ERROR_SCHEMA: Json = {
    "type": "object",
    "required": ["error"],
    "properties": {"error": {
        "type": "object",
        "required": ["message", "type", "param", "code"],
        "properties": {
            "message": {"type": "string"},
            "type": {"type": "string"},
            "param": {"type": ["string", "null"]},
            "code": {"type": ["string", "integer", "null"]},
        },
    }},
}
_ID_HEADER = {"X-Request-Id": {"$ref": "#/components/headers/X-Request-Id"}}


def _operation(op: Operation, body_ref: Json | None, auth: bool) -> Json:
    responses: Json = {str(op.ok_status): _success(op)}
    for status in op.statuses:
        responses[str(status)] = _error(status)
    if op.health:
        responses["503"] = {"description": "Not ready (or draining).", "headers": _ID_HEADER}
    operation: Json = {"summary": op.summary, "responses": responses}
    if op.query:
        operation["parameters"] = list(op.query)
    if body_ref is not None:
        operation["requestBody"] = {"required": True,
                                    "content": {"application/json": {"schema": body_ref}}}
    if auth and op.auth:
        operation["security"] = [{"bearer": []}]
    return operation


def _success(op: Operation) -> Json:
    if op.health:
        return {"description": "Ready.", "headers": _ID_HEADER}
    content: Json = {"application/json": {"schema": {"type": ["object", "array"]}}}
    if op.ok == "text":
        content = {media: {"schema": {"type": "string"}}
                   for media in ("text/plain", "application/openmetrics-text")}
    elif op.ok == "json+sse":
        # One server-sent event: each `data:` a JSON chunk, the last `[DONE]`.
        content["text/event-stream"] = {"schema": {
            "type": "object", "required": ["data"],
            "properties": {"data": {"type": "string"}, "event": {"type": "string"}}}}
    return {"description": "Success (with `stream: true`, server-sent events)."
            if op.ok == "json+sse" else "Success.", "headers": _ID_HEADER, "content": content}


def _error(status: int) -> Json:
    headers = dict(_ID_HEADER)
    if status == 429:
        headers["Retry-After"] = {"schema": {"type": "integer"},
                                  "description": "Seconds to wait before retrying."}
    return {"description": _REASONS[status], "headers": headers,
            "content": {"application/json": {"schema": {"$ref": "#/components/schemas/Error"}}}}


def _version() -> str:
    try:
        return metadata.version("corestream")
    except metadata.PackageNotFoundError:
        return "unknown"
