"""The frontend's view of each generation request: Prometheus metrics and its span.

`FrontendMetrics` holds the process's request metrics (vLLM names, `corestream:`
prefix). `RequestTelemetry` follows one request: it opens the request's span
(GenAI conventions: `text_completion {model}`) under the client's
`traceparent` (or the RPC span the interceptor made from it), times the phases
(validate, tokenize, route, detokenize) as child spans, observes TTFT, the
inter-token latency and the end-to-end latency, and counts how the request
ended. The engine continues the trace from the `trace_headers` it gets.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from types import TracebackType
from typing import TYPE_CHECKING, Any

import grpc
from corestream.common.v1 import common_pb2
from corestream.generate.v1 import generate_service_pb2 as generate_pb2
from opentelemetry import trace
from prometheus_client import CollectorRegistry, Counter, Histogram

from services.common import tracing as tr
from services.common.logs import REQUEST_ID
from services.common.metrics import (
    ITL_BUCKETS,
    PREFIX,
    REQUEST_LATENCY_BUCKETS,
    TTFT_BUCKETS,
)
from services.common.sampling import SamplingParams
from services.common.tracing import Tracing
from services.frontend.errors import RequestError

if TYPE_CHECKING:
    from services.frontend.routing.balancer import Route

# One line per request, like an access log (JSON logs carry its request and trace ids).
log = logging.getLogger("services.frontend.requests")

# vLLM's finished_reason label values, so its dashboards read ours.
_FINISHED_REASON = {
    common_pb2.FINISH_REASON_LENGTH: "length",
    common_pb2.FINISH_REASON_EOS_TOKEN: "stop",
    common_pb2.FINISH_REASON_STOP_TOKEN: "stop",
    common_pb2.FINISH_REASON_STOP_STRING: "stop",
    common_pb2.FINISH_REASON_STOP: "stop",
    common_pb2.FINISH_REASON_ABORT: "abort",
    common_pb2.FINISH_REASON_PAUSED: "abort",  # vLLM ends a pause's requests as aborted
    common_pb2.FINISH_REASON_SCHEMA_MISMATCH: "schema_mismatch",
}
_LABELS = ("model_name", "engine")
_NS = 1_000_000_000


class FrontendMetrics:
    def __init__(self, registry: CollectorRegistry, model_name: str) -> None:
        self.model_name = model_name
        self.ttft = Histogram(PREFIX + "time_to_first_token_seconds",
                              "Time from the request's arrival to its first token.",
                              _LABELS, registry=registry, buckets=TTFT_BUCKETS)
        self.itl = Histogram(PREFIX + "inter_token_latency_seconds",
                             "Time between two successive outputs of a sample.",
                             _LABELS, registry=registry, buckets=ITL_BUCKETS)
        self.e2e = Histogram(PREFIX + "e2e_request_latency_seconds",
                             "Time from the request's arrival to its last output.",
                             _LABELS, registry=registry, buckets=REQUEST_LATENCY_BUCKETS)
        self.success = Counter(PREFIX + "request_success",
                               "Samples that finished, by finish reason (vLLM's values).",
                               (*_LABELS, "finished_reason"), registry=registry)
        self.rejected = Counter(PREFIX + "requests_rejected",
                                "Requests that ended with an error, by status code and reason.",
                                ("model_name", "code", "reason"), registry=registry)
        self.routed = Counter(PREFIX + "routed_requests",
                              "Requests routed, by policy and whether the chosen engine was "
                              "predicted to hold a prefix of the prompt (prefix_hit).",
                              ("model_name", "policy", "prefix_hit"), registry=registry)
        self.predicted_cached = Counter(
            PREFIX + "routing_predicted_cached_tokens",
            "Prompt tokens the routing index predicted the chosen engine holds, for "
            "requests that finished (compare with routing_actual_cached_tokens).",
            ("model_name",), registry=registry)
        self.actual_cached = Counter(
            PREFIX + "routing_actual_cached_tokens",
            "Prompt tokens the engines served from their prefix cache, for requests that "
            "finished.", ("model_name",), registry=registry)
        self.relaxed_constraints = Counter(
            PREFIX + "relaxed_constraints",
            "Requests whose JSON Schema the grammar only approximates, by keyword (oneOf "
            "followed as anyOf, or a keyword such as not left to the output check); "
            "outputs that then fail are counted as request_success with finished_reason "
            "schema_mismatch.", ("model_name", "keyword"), registry=registry)

    def count_rejected(self, exc: BaseException) -> None:
        code, reason = _error_labels(exc)
        self.rejected.labels(self.model_name, code, reason).inc()

    def count_relaxed(self, keywords: tuple[str, ...]) -> None:
        for keyword in keywords:
            self.relaxed_constraints.labels(self.model_name, keyword).inc()


class RequestTelemetry:
    """One request's span and metrics; use as a context manager around its handling."""

    def __init__(self, tracing: Tracing, metrics: FrontendMetrics, request_id: str,
                 metadata: Mapping[str, Any], operation: str = "text_completion") -> None:
        self._tracing = tracing
        self._metrics = metrics
        self.request_id = request_id
        self._client_headers = {k: str(metadata[k]) for k in tr.TRACE_HEADERS if k in metadata}
        self._start = time.monotonic()
        self._engine = ""
        self._predicted_cached: int | None = None
        self._itl: Histogram | None = None  # labelled on first use: labels() is not cheap
        self._first_token = 0.0
        self._last_output: dict[int, float] = {}
        self._finish_reasons: dict[int, str] = {}
        self._usage: common_pb2.Usage | None = None
        self._detokenize_s = 0.0
        self._detokenize_start = 0.0
        self._detokenize_end = 0.0
        self._completions: dict[int, list[str]] = {}
        # The interceptor's RPC span already continues the client's trace; without
        # one (tracing off there, or a test server) the client's headers are read here.
        parent = None if trace.get_current_span().get_span_context().is_valid else (
            tr.extract(self._client_headers))
        self.span = tracing.tracer.start_span(
            f"{operation} {metrics.model_name}", context=parent,
            attributes={tr.GEN_AI_OPERATION: operation, tr.GEN_AI_SYSTEM:
                        tr.GEN_AI_SYSTEM_NAME, tr.GEN_AI_MODEL: metrics.model_name,
                        tr.GEN_AI_RESPONSE_ID: request_id})
        self._context = trace.set_span_in_context(self.span)
        self._request_id_token: Any = None

    def __enter__(self) -> RequestTelemetry:
        self._request_id_token = REQUEST_ID.set(self.request_id)
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        try:
            self._finish(exc)
        finally:
            # A stream closed by a client cancel may end in another context.
            with contextlib.suppress(ValueError):
                REQUEST_ID.reset(self._request_id_token)

    async def __aenter__(self) -> RequestTelemetry:
        return self.__enter__()

    async def __aexit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                        tb: TracebackType | None) -> None:
        self.__exit__(exc_type, exc, tb)

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        """A child span of the request around a frontend phase."""
        with self._tracing.tracer.start_as_current_span(name, context=self._context):
            yield

    def trace_headers(self) -> dict[str, str]:
        """What the engine gets: our span's context, or the client's headers untouched
        when this frontend does not trace."""
        if self._tracing.enabled and self.span.get_span_context().is_valid:
            return tr.inject(self._context)
        return dict(self._client_headers)

    def on_prepared(self, sampling: SamplingParams, prompt: str | None,
                    num_prompt_tokens: int) -> None:
        span = self.span
        if not span.is_recording():
            return
        span.set_attribute(tr.GEN_AI_INPUT_TOKENS, num_prompt_tokens)
        for key, value in ((tr.GEN_AI_MAX_TOKENS, sampling.max_tokens),
                           (tr.GEN_AI_TEMPERATURE, sampling.temperature),
                           (tr.GEN_AI_TOP_P, sampling.top_p),
                           (tr.GEN_AI_TOP_K, sampling.top_k),
                           (tr.GEN_AI_SEED, sampling.seed),
                           (tr.GEN_AI_N, sampling.n)):
            if value is not None:
                span.set_attribute(key, value)
        if self._tracing.include_content and prompt is not None:
            span.set_attribute(tr.GEN_AI_PROMPT, prompt)

    def on_routed(self, route: Route, policy: str) -> None:
        """Call inside the `route` phase: its span records why the engine was chosen."""
        engine_index = route.client.engine_index
        self._engine = "" if engine_index is None else str(engine_index)
        self._predicted_cached = route.cached_tokens
        self.span.set_attribute("corestream.engine.index", self._engine)
        self._metrics.routed.labels(self._metrics.model_name, policy,
                                    str(route.cached_tokens > 0).lower()).inc()
        span = trace.get_current_span()
        if span.is_recording():
            span.set_attributes({"corestream.route.policy": policy,
                                 "corestream.route.reason": route.reason,
                                 "corestream.route.engine": route.client.address,
                                 "corestream.route.predicted_cached_tokens":
                                     route.cached_tokens})

    def detokenized(self, started: float) -> None:
        """Add the time since `started` (time.monotonic()) to the detokenize phase."""
        now = time.monotonic()
        self._detokenize_s += now - started
        self._detokenize_start = self._detokenize_start or started
        self._detokenize_end = now

    def on_chunk(self, chunk: generate_pb2.GenerateStreamResponse) -> None:
        now = time.monotonic()
        labels = (self._metrics.model_name, self._engine)
        if chunk.token_ids:
            if not self._first_token:
                self._first_token = now
                self._metrics.ttft.labels(*labels).observe(now - self._start)
            last = self._last_output.get(chunk.index)
            if last is not None:
                if self._itl is None:
                    self._itl = self._metrics.itl.labels(*labels)
                self._itl.observe(now - last)
            self._last_output[chunk.index] = now
        if self._tracing.include_content and chunk.text:
            self._completions.setdefault(chunk.index, []).append(chunk.text)
        if chunk.finish_reason:
            reason = _FINISHED_REASON.get(chunk.finish_reason, "error")
            self._finish_reasons[chunk.index] = reason
            self._metrics.success.labels(*labels, reason).inc()
        if chunk.HasField("usage"):
            self._usage = chunk.usage

    def _finish(self, exc: BaseException | None) -> None:
        now = time.monotonic()
        span = self.span
        if exc is None and self._finish_reasons:
            self._metrics.e2e.labels(self._metrics.model_name, self._engine).observe(
                now - self._start)
            usage = self._usage or common_pb2.Usage()
            if self._predicted_cached is not None:
                self._metrics.predicted_cached.labels(self._metrics.model_name).inc(
                    self._predicted_cached)
                self._metrics.actual_cached.labels(self._metrics.model_name).inc(
                    usage.cached_tokens)
            log.info("request finished (%s) on engine %s: %d prompt + %d generated tokens "
                     "in %.3f s", ",".join(self._finish_reasons.values()), self._engine,
                     usage.prompt_tokens, usage.completion_tokens, now - self._start)
        elif exc is not None:
            code, reason = _error_labels(exc)
            log.info("request failed: %s %s", code, reason)
            self._metrics.count_rejected(exc)
            span.set_status(trace.Status(trace.StatusCode.ERROR, f"{code}: {exc}"[:300]))
            span.set_attribute("error.type", code)
        if span.is_recording():
            self._record_outcome(span, now)
        span.end()

    def _record_outcome(self, span: trace.Span, now: float) -> None:
        if self._finish_reasons:
            span.set_attribute(tr.GEN_AI_FINISH_REASONS,
                               [self._finish_reasons[i] for i in sorted(self._finish_reasons)])
        if self._usage is not None:
            span.set_attribute(tr.GEN_AI_OUTPUT_TOKENS, self._usage.completion_tokens)
            span.set_attribute("corestream.usage.cached_tokens", self._usage.cached_tokens)
        if self._first_token:
            span.set_attribute(tr.LATENCY_TTFT, self._first_token - self._start)
        span.set_attribute(tr.LATENCY_E2E, now - self._start)
        if self._completions:
            span.set_attribute(tr.GEN_AI_COMPLETION, [
                "".join(self._completions[i]) for i in sorted(self._completions)])
        if self._detokenize_end:
            # One span over the streaming part: detokenizing is spread over every
            # output, so its summed time goes in an attribute.
            wall = time.time()
            detok = self._tracing.tracer.start_span(
                "detokenize",
                context=self._context,
                start_time=_wall_ns(wall, now, self._detokenize_start),
                attributes={"corestream.detokenize.seconds": self._detokenize_s})
            detok.end(end_time=_wall_ns(wall, now, self._detokenize_end))


def _wall_ns(wall_now: float, mono_now: float, mono: float) -> int:
    return int((wall_now - (mono_now - mono)) * _NS)


def _error_labels(exc: BaseException) -> tuple[str, str]:
    if isinstance(exc, RequestError):
        return exc.code.name, exc.reason or exc.field or ""
    if isinstance(exc, TimeoutError):
        return grpc.StatusCode.DEADLINE_EXCEEDED.name, "REQUEST_TIMEOUT"
    if not isinstance(exc, Exception):  # CancelledError, GeneratorExit
        return grpc.StatusCode.CANCELLED.name, "CLIENT_CANCELLED"
    return grpc.StatusCode.UNKNOWN.name, type(exc).__name__
