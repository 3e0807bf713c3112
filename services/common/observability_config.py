"""ObservabilityConfig: metrics endpoint, tracing and log format, shared by every service."""

from __future__ import annotations

import math
from dataclasses import dataclass

from services.common.config import doc

LOG_FORMATS = ("text", "json")


@dataclass(frozen=True)
class ObservabilityConfig:
    metrics_port: int = doc(
        "Port of the Prometheus /metrics HTTP endpoint; 0 turns it off. Under `corestream "
        "serve`, one port serves every process's metrics (serve's --metrics-port).",
        default=0,
    )
    metrics_host: str = doc(
        "Interface the metrics endpoint binds to; empty means the service's --host.", default=""
    )
    otlp_endpoint: str = doc(
        "host:port of an OTLP/gRPC trace collector; empty turns tracing off. A dead or "
        "missing collector never slows serving: spans are sent in the background and "
        "dropped when the buffer is full.", default=""
    )
    trace_sample_ratio: float = doc(
        "Fraction of new traces that are sampled (parent-based: a caller's sampling "
        "decision in traceparent wins).", default=1.0
    )
    trace_include_content: bool = doc(
        "Record prompts and generated text in spans (off: only counts and settings).",
        default=False,
    )
    log_format: str = doc(
        "Log line format: text, or json (one object per line, with request and trace ids).",
        default="text",
    )

    def __post_init__(self) -> None:
        if not 0 <= self.metrics_port <= 65535:
            raise ValueError(f"metrics_port must be in [0, 65535], got {self.metrics_port}")
        if not (0.0 <= self.trace_sample_ratio <= 1.0) or math.isnan(self.trace_sample_ratio):
            raise ValueError(
                f"trace_sample_ratio must be in [0, 1], got {self.trace_sample_ratio}")
        if self.log_format not in LOG_FORMATS:
            raise ValueError(f"log_format must be one of {LOG_FORMATS}, got {self.log_format!r}")
        if self.otlp_endpoint and ":" not in self.otlp_endpoint.split("//")[-1]:
            raise ValueError(f"otlp_endpoint must be host:port, got {self.otlp_endpoint!r}")
