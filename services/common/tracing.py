"""OpenTelemetry tracing for one process: provider, exporter, propagation, interceptors.

Spans go to an OTLP/gRPC collector (`--otlp-endpoint`) through a batch processor:
`span.end()` only appends to an in-memory queue, a background thread exports,
and a full queue drops spans, so a slow, dead or missing collector never slows
or breaks serving. Sampling is parent-based: a caller's `traceparent` decides
for its trace, new traces are sampled at `--trace-sample-ratio`.

Context crosses process boundaries as W3C `traceparent` / `tracestate`: in gRPC
metadata (the instrumentation's interceptors read and write it) and, on the
engine's multiplexed Session stream, in each add message's `trace_headers`.
Health checks and reflection are never traced.

Span attributes follow the OpenTelemetry GenAI conventions where one exists; the
latency breakdown uses vLLM's `gen_ai.latency.*` names.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Mapping
from typing import Any

from opentelemetry import propagate, trace
from opentelemetry.context import Context
from opentelemetry.instrumentation.grpc import aio_server_interceptor, server_interceptor
from opentelemetry.instrumentation.grpc import filters as grpc_filters
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter
from opentelemetry.sdk.trace.sampling import ParentBased, TraceIdRatioBased

from services.common.observability_config import ObservabilityConfig

log = logging.getLogger(__name__)

TRACE_HEADERS = ("traceparent", "tracestate")
INSTRUMENTATION = "corestream"

# GenAI semantic conventions (gen_ai.*), and vLLM's latency attributes.
GEN_AI_OPERATION = "gen_ai.operation.name"
GEN_AI_SYSTEM = "gen_ai.system"
GEN_AI_MODEL = "gen_ai.request.model"
GEN_AI_MAX_TOKENS = "gen_ai.request.max_tokens"
GEN_AI_TEMPERATURE = "gen_ai.request.temperature"
GEN_AI_TOP_P = "gen_ai.request.top_p"
GEN_AI_TOP_K = "gen_ai.request.top_k"
GEN_AI_SEED = "gen_ai.request.seed"
GEN_AI_N = "gen_ai.request.choice.count"
GEN_AI_RESPONSE_ID = "gen_ai.response.id"
GEN_AI_FINISH_REASONS = "gen_ai.response.finish_reasons"
GEN_AI_INPUT_TOKENS = "gen_ai.usage.input_tokens"
GEN_AI_OUTPUT_TOKENS = "gen_ai.usage.output_tokens"
GEN_AI_PROMPT = "gen_ai.prompt"
GEN_AI_COMPLETION = "gen_ai.completion"
LATENCY_QUEUE = "gen_ai.latency.time_in_queue"
LATENCY_TTFT = "gen_ai.latency.time_to_first_token"
LATENCY_E2E = "gen_ai.latency.e2e"
LATENCY_PREFILL = "gen_ai.latency.time_in_model_prefill"
LATENCY_DECODE = "gen_ai.latency.time_in_model_decode"
GEN_AI_SYSTEM_NAME = "corestream"

# Export: each attempt (with retries) gives up after this long; shutdown waits at
# most SHUTDOWN_TIMEOUT_S for the last spans, collector or not.
EXPORT_TIMEOUT_S = 3.0
SHUTDOWN_TIMEOUT_S = 3.0
MAX_QUEUED_SPANS = 4096
EXPORT_DELAY_MS = 500


def _untraced_rpc() -> Any:
    return grpc_filters.negate(grpc_filters.any_of(
        grpc_filters.service_prefix("grpc.health."),
        grpc_filters.service_prefix("grpc.reflection."),
    ))


class Tracing:
    """A process's tracer. With no collector configured it is off: the tracer makes
    non-recording spans and no interceptor is installed, but `traceparent` still
    passes through unchanged."""

    def __init__(
        self,
        service: str,
        config: ObservabilityConfig,
        attributes: Mapping[str, Any] | None = None,
        exporter: SpanExporter | None = None,
    ) -> None:
        self.include_content = config.trace_include_content
        self.provider: TracerProvider | None = None
        if exporter is None and config.otlp_endpoint:
            # Imported here: the exporter pulls in its own gRPC stubs.
            from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter

            exporter = OTLPSpanExporter(endpoint=config.otlp_endpoint, insecure=True,
                                        timeout=EXPORT_TIMEOUT_S)
        if exporter is not None:
            resource = Resource.create({"service.name": f"corestream-{service}",
                                        **(attributes or {})})
            self.provider = TracerProvider(
                resource=resource,
                sampler=ParentBased(TraceIdRatioBased(config.trace_sample_ratio)),
            )
            self.provider.add_span_processor(BatchSpanProcessor(
                exporter, max_queue_size=MAX_QUEUED_SPANS, schedule_delay_millis=EXPORT_DELAY_MS,
            ))
            log.info("tracing to %s (sample ratio %g)", config.otlp_endpoint or exporter,
                     config.trace_sample_ratio)
        self.tracer: trace.Tracer = (
            self.provider.get_tracer(INSTRUMENTATION) if self.provider is not None
            else trace.NoOpTracer()
        )

    @property
    def enabled(self) -> bool:
        return self.provider is not None

    def server_interceptor(self) -> Any:
        """A span per RPC of a threaded server (None when off)."""
        if self.provider is None:
            return None
        return server_interceptor(tracer_provider=self.provider, filter_=_untraced_rpc())

    def aio_server_interceptor(self) -> Any:
        """A span per RPC of an asyncio server (None when off)."""
        if self.provider is None:
            return None
        return aio_server_interceptor(tracer_provider=self.provider, filter_=_untraced_rpc())

    def shutdown(self) -> None:
        """Flush what is queued, waiting at most SHUTDOWN_TIMEOUT_S (a dead collector
        must not hold up the process's exit)."""
        if self.provider is None:
            return
        thread = threading.Thread(target=self.provider.shutdown, name="tracing-shutdown",
                                  daemon=True)
        thread.start()
        thread.join(SHUTDOWN_TIMEOUT_S)


def extract(headers: Mapping[str, str]) -> Context | None:
    """The remote parent carried by W3C headers (None when there is none)."""
    if not headers:
        return None
    return propagate.extract(dict(headers))


def inject(context: Context | None = None) -> dict[str, str]:
    """W3C headers for the current (or given) span, to carry it to another process."""
    carrier: dict[str, str] = {}
    propagate.inject(carrier, context=context)
    return {k: v for k, v in carrier.items() if k in TRACE_HEADERS}


def trace_id_hex(span: trace.Span) -> str:
    ctx = span.get_span_context()
    return format(ctx.trace_id, "032x") if ctx.is_valid else ""
