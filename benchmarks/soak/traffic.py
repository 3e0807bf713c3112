"""The soak's requests: a seeded mix over every door, and how each one ended.

A `RequestSpec` is drawn from the run's seed alone, so two runs with one seed send the
same requests in the same order. `send` runs one through its door with a synchronous
client and returns an `Outcome`: the status as a gRPC code name (HTTP statuses are
mapped back to the code the door derived them from), the text of each sample, and when
it started and ended. Greedy requests carry a `reference_key`: the requests that must
produce the same text (same prompt, length, stops, constraint and kind), whatever door,
engine, batch or restart served them.
"""

from __future__ import annotations

import json
import random
import time
from dataclasses import dataclass, field
from typing import Any

import grpc
import openai
from corestream.common.v1 import common_pb2
from corestream.generate.v1 import chat_service_pb2 as chat_pb
from corestream.generate.v1 import generate_service_pb2 as pb

DOORS = ("grpc_generate", "grpc_stream", "grpc_chat_stream", "http_completion",
         "http_completion_stream", "http_chat", "http_chat_stream")
CHAT_DOORS = ("grpc_chat_stream", "http_chat", "http_chat_stream")
STREAM_DOORS = ("grpc_stream", "grpc_chat_stream", "http_completion_stream",
                "http_chat_stream")

PROMPTS = (
    "The capital of France is",
    "Write a haiku about the sea.",
    "List three colours:",
    "def fibonacci(n):",
    "Once upon a time",
    "Translate to German: good morning",
    "SELECT name FROM users WHERE",
    "2 + 2 =",
)

JSON_SCHEMA = {
    "type": "object",
    "properties": {"id": {"type": "integer"}, "name": {"type": "string", "maxLength": 12}},
    "required": ["id", "name"],
    "additionalProperties": False,
}
REGEX = r"[a-z]{1,8}( [a-z]{1,8}){0,4}"
CHOICES = ("red", "green", "blue", "yellow")
GRAMMAR = 'start: "yes" | "no" | NUMBER\nNUMBER: /[0-9]{1,4}/\n'
CONSTRAINTS = ("json", "regex", "choice", "grammar")
STOP_STRINGS = (("e",), ("th", "\n"))

TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city.",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                       "required": ["city"]},
    },
}

# HTTP statuses of the door (http_errors._HTTP_STATUS) as the codes behind them.
HTTP_CODES = {200: "OK", 400: "INVALID_ARGUMENT", 401: "UNAUTHENTICATED",
              404: "NOT_FOUND", 413: "RESOURCE_EXHAUSTED", 429: "RESOURCE_EXHAUSTED",
              499: "CANCELLED", 503: "UNAVAILABLE", 504: "DEADLINE_EXCEEDED"}
HTTP_TYPES = {"invalid_request_error": "INVALID_ARGUMENT", "rate_limit_error":
              "RESOURCE_EXHAUSTED", "cancelled": "CANCELLED", "service_unavailable":
              "UNAVAILABLE", "timeout": "DEADLINE_EXCEEDED"}
CONNECTION_LOST = "CONNECTION_LOST"
"""An HTTP request whose connection failed or broke (the frontend was killed)."""
CLIENT_CANCELLED = "CLIENT_CANCELLED"
"""The client itself stopped reading, as the spec said (a disconnect on purpose)."""
CLIENT_TIMEOUT = "CLIENT_TIMEOUT"
"""The client's own guard ran out: the request hung (a violation unless its deadline
was that short)."""


@dataclass(frozen=True)
class RequestSpec:
    index: int
    door: str
    prompt: str
    max_tokens: int
    greedy: bool
    n: int
    logprobs: bool
    stop: tuple[str, ...]
    constraint: str
    """"" or one of CONSTRAINTS."""
    tools: bool
    deadline_s: float | None
    """The request's own deadline (gRPC deadline, HTTP client timeout); None: none."""
    disconnect_after: int | None
    """A stream the client abandons after this many chunks."""
    invalid: bool = False
    """Sent with a bad parameter on purpose: must be INVALID_ARGUMENT. gRPC requests get
    temperature -1 (refused by the request path); HTTP ones a value the door itself
    refuses (top logprobs past 20 for completions, a regex constraint in a chat),
    before any request exists: both must count in the frontend's metrics."""

    @property
    def chat(self) -> bool:
        return self.door in CHAT_DOORS

    @property
    def reference_key(self) -> tuple[Any, ...] | None:
        """Requests with the same key must produce the same text; None: no reference
        (sampled, abandoned, or bad on purpose)."""
        if not self.greedy or self.invalid or self.disconnect_after is not None:
            return None
        return (self.chat, self.prompt, self.max_tokens, self.stop, self.constraint,
                self.tools)

    def reference_spec(self) -> RequestSpec:
        """The request that makes this one's reference text: the same key, sent without
        faults through gRPC (streamed chat for chat requests), one sample, no deadline."""
        door = "grpc_chat_stream" if self.chat else "grpc_generate"
        return RequestSpec(-1, door, self.prompt, self.max_tokens, True, 1, False,
                           self.stop, self.constraint, self.tools, None, None)


@dataclass
class Outcome:
    spec: RequestSpec
    code: str
    message: str
    texts: list[str]
    started: float
    """time.monotonic()"""
    ended: float
    chunks: int = 0
    retry_hint: bool = False
    """An overload refusal told the client when to retry (retry-after-ms, Retry-After)."""

    @property
    def elapsed(self) -> float:
        return self.ended - self.started


@dataclass
class Clients:
    """One gRPC channel and one HTTP client, shared by the sending threads."""

    generate: Any
    chat: Any
    http: openai.OpenAI
    model: str
    hang_s: float
    """The guard of a request without a deadline of its own."""
    streams: dict[int, Any] = field(default_factory=dict)


def draw(rng: random.Random, index: int, doors: tuple[str, ...] = DOORS) -> RequestSpec:
    door = rng.choice(doors)
    chat = door in CHAT_DOORS
    greedy = rng.random() < 0.7
    # Chat takes its constraint as response_format (a JSON schema) only.
    constraint = rng.choice(("json",) if chat else CONSTRAINTS) if rng.random() < 0.25 else ""
    stream = door in STREAM_DOORS
    return RequestSpec(
        index=index,
        door=door,
        prompt=rng.choice(PROMPTS),
        max_tokens=rng.choice((8, 16, 32, 64)),
        greedy=greedy,
        n=2 if rng.random() < 0.15 else 1,
        logprobs=rng.random() < 0.2,
        stop=rng.choice(STOP_STRINGS) if rng.random() < 0.2 else (),
        constraint=constraint,
        tools=chat and not constraint and rng.random() < 0.3,
        deadline_s=rng.choice((0.05, 0.5, 5.0)) if rng.random() < 0.1 else None,
        disconnect_after=rng.randint(0, 3) if stream and rng.random() < 0.1 else None,
        invalid=rng.random() < 0.03,
    )


def send(spec: RequestSpec, clients: Clients) -> Outcome:
    started = time.monotonic()
    outcome = Outcome(spec, "OK", "", [""] * spec.n, started, started)
    try:
        if spec.door.startswith("grpc"):
            _send_grpc(spec, clients, outcome)
        else:
            _send_http(spec, clients, outcome)
    except grpc.RpcError as e:
        code = e.code()
        outcome.code = code.name if code is not None else "UNKNOWN"
        outcome.message = e.details() or ""
        trailers = dict(e.trailing_metadata() or ())  # type: ignore[attr-defined]
        outcome.retry_hint = "retry-after-ms" in trailers
        if outcome.code == "CANCELLED" and spec.disconnect_after is not None \
                and outcome.chunks >= spec.disconnect_after:
            outcome.code = CLIENT_CANCELLED
        elif outcome.code == "DEADLINE_EXCEEDED" and spec.deadline_s is None:
            outcome.code = CLIENT_TIMEOUT
    except openai.APITimeoutError as e:
        outcome.code = "DEADLINE_EXCEEDED" if spec.deadline_s is not None else CLIENT_TIMEOUT
        outcome.message = str(e)
    except openai.APIConnectionError as e:
        outcome.code, outcome.message = CONNECTION_LOST, str(e)
    except openai.APIStatusError as e:
        outcome.code = HTTP_CODES.get(e.status_code, f"HTTP_{e.status_code}")
        outcome.message = str(e.body)
        outcome.retry_hint = "retry-after" in e.response.headers
    except openai.APIError as e:
        # An error event inside a stream (after the 200): OpenAI's error body.
        body = e.body if isinstance(e.body, dict) else {}
        outcome.code = HTTP_TYPES.get(str(body.get("type")), f"HTTP_ERROR_{body.get('type')}")
        outcome.message = str(body.get("message", e))
    except _Abandoned:
        outcome.code = CLIENT_CANCELLED
    outcome.ended = time.monotonic()
    return outcome


class _Abandoned(Exception):
    pass


def _sampling(spec: RequestSpec) -> common_pb2.SamplingParams:
    params = common_pb2.SamplingParams(
        max_tokens=spec.max_tokens, n=spec.n, stop=list(spec.stop),
        temperature=-1.0 if spec.invalid else (0.0 if spec.greedy else 0.8))
    if not spec.greedy:
        params.seed = spec.index
    if spec.logprobs:
        params.logprobs = 2
    if spec.constraint == "json" and not spec.chat:
        params.json_schema = json.dumps(JSON_SCHEMA)
    elif spec.constraint == "regex":
        params.regex = REGEX
    elif spec.constraint == "choice":
        params.choice.choices.extend(CHOICES)
    elif spec.constraint == "grammar":
        params.grammar = GRAMMAR
    return params


def _timeout(spec: RequestSpec, clients: Clients) -> float:
    return spec.deadline_s if spec.deadline_s is not None else clients.hang_s


def _send_grpc(spec: RequestSpec, clients: Clients, outcome: Outcome) -> None:
    timeout = _timeout(spec, clients)
    if spec.door == "grpc_generate":
        reply = clients.generate.Generate(
            pb.GenerateRequest(text=spec.prompt, sampling=_sampling(spec)), timeout=timeout)
        for completion in reply.completions:
            outcome.texts[completion.index] = completion.text
        return
    if spec.door == "grpc_stream":
        call = clients.generate.GenerateStream(
            pb.GenerateStreamRequest(text=spec.prompt, sampling=_sampling(spec)),
            timeout=timeout)
        _read_grpc_stream(spec, call, outcome, lambda chunk: chunk.text)
        return
    request = chat_pb.ChatStreamRequest(
        messages=[chat_pb.ChatMessage(role="user", content=spec.prompt)],
        sampling=_sampling(spec))
    if spec.constraint == "json":
        request.response_format.type = chat_pb.RESPONSE_FORMAT_TYPE_JSON_SCHEMA
        request.response_format.json_schema = json.dumps(JSON_SCHEMA)
    if spec.tools:
        function = TOOL["function"]
        request.tools.append(chat_pb.Tool(name=function["name"],
                                          description=function["description"],
                                          parameters=json.dumps(function["parameters"])))
    call = clients.chat.ChatStream(request, timeout=timeout)
    _read_grpc_stream(spec, call, outcome, _chat_delta)


def _chat_delta(chunk: Any) -> str:
    return chunk.content + "".join(_call_text(c.name, c.arguments) for c in chunk.tool_calls)


def _call_text(name: str | None, arguments: str | None) -> str:
    """A tool call's piece as text, the same for every door and for whole or streamed
    calls: "<name|" where a call starts, then its arguments."""
    return (f"<{name}|" if name else "") + (arguments or "")


def _read_grpc_stream(spec: RequestSpec, call: Any, outcome: Outcome, delta: Any) -> None:
    for chunk in call:
        outcome.chunks += 1
        outcome.texts[chunk.index] += delta(chunk)
        if spec.disconnect_after is not None and outcome.chunks >= spec.disconnect_after:
            call.cancel()
            raise _Abandoned


def _http_extra(spec: RequestSpec) -> dict[str, Any]:
    extra: dict[str, Any] = {}
    structured: dict[str, Any] = {}
    if spec.constraint == "json" and not spec.chat:
        structured["json"] = JSON_SCHEMA
    elif spec.constraint == "regex":
        structured["regex"] = REGEX
    elif spec.constraint == "choice":
        structured["choice"] = list(CHOICES)
    elif spec.constraint == "grammar":
        structured["grammar"] = GRAMMAR
    if structured:
        extra["structured_outputs"] = structured
    return extra


def _send_http(spec: RequestSpec, clients: Clients, outcome: Outcome) -> None:
    client = clients.http.with_options(timeout=_timeout(spec, clients), max_retries=0)
    stream = spec.door.endswith("_stream")
    common: dict[str, Any] = {
        "model": clients.model, "max_tokens": spec.max_tokens, "n": spec.n,
        "temperature": 0.0 if spec.greedy else 0.8,
        "stop": list(spec.stop) or None, "stream": stream,
        "extra_body": _http_extra(spec),
    }
    if not spec.greedy:
        common["seed"] = spec.index
    if spec.invalid:
        common["extra_body"] = {"structured_outputs": {"regex": REGEX}}
    if spec.chat:
        kwargs: dict[str, Any] = dict(common, messages=[{"role": "user",
                                                          "content": spec.prompt}])
        if spec.logprobs:
            kwargs.update(logprobs=True, top_logprobs=2)
        if spec.constraint == "json":
            kwargs["response_format"] = {"type": "json_schema", "json_schema": {
                "name": "record", "schema": JSON_SCHEMA}}
        if spec.tools:
            kwargs["tools"] = [TOOL]
        answer = client.chat.completions.create(**kwargs)
        if not stream:
            for choice in answer.choices:
                calls = "".join(_call_text(c.function.name, c.function.arguments)
                                for c in choice.message.tool_calls or ())
                outcome.texts[choice.index] = (choice.message.content or "") + calls
            return
        _read_http_stream(spec, answer, outcome, _http_chat_delta)
        return
    kwargs = dict(common, prompt=spec.prompt)
    if spec.logprobs or spec.invalid:
        kwargs["logprobs"] = 50 if spec.invalid else 2
    answer = client.completions.create(**kwargs)
    if not stream:
        for choice in answer.choices:
            outcome.texts[choice.index] = choice.text
        return
    _read_http_stream(spec, answer, outcome, lambda choice: choice.text or "")


def _http_chat_delta(choice: Any) -> str:
    delta = choice.delta
    calls = "".join(_call_text(c.function.name, c.function.arguments)
                    for c in delta.tool_calls or () if c.function)
    return (delta.content or "") + calls


def _read_http_stream(spec: RequestSpec, stream: Any, outcome: Outcome, delta: Any) -> None:
    with stream:
        for chunk in stream:
            outcome.chunks += 1
            for choice in chunk.choices:
                outcome.texts[choice.index] += delta(choice)
            if spec.disconnect_after is not None and outcome.chunks >= spec.disconnect_after:
                raise _Abandoned

