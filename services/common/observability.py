"""One process's telemetry: metrics registry and endpoint, gRPC call metrics, tracing.

Each service's main builds one `Observability` from its ObservabilityConfig, hands
its interceptors to its gRPC server and shuts it down last.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping
from typing import Any

from opentelemetry.sdk.trace.export import SpanExporter

from services.common.metrics import MetricsServer, new_registry, serve_metrics
from services.common.metrics_grpc import GrpcMetrics
from services.common.observability_config import ObservabilityConfig
from services.common.tracing import Tracing

log = logging.getLogger(__name__)


class Observability:
    def __init__(
        self,
        service: str,
        config: ObservabilityConfig,
        host: str,
        configs: Iterable[Any] = (),
        attributes: Mapping[str, Any] | None = None,
        exporter: SpanExporter | None = None,
    ) -> None:
        self.config = config
        self.registry = new_registry()
        self.grpc_metrics = GrpcMetrics(self.registry)
        self.tracing = Tracing(service, config, attributes, exporter)
        self._service = service
        self._host = host
        self._configs = list(configs)
        self.metrics_server: MetricsServer | None = None

    def start_metrics(self) -> int:
        """Serve /metrics (after the service's own metrics are registered); the port."""
        self.metrics_server = serve_metrics(self._service, self.config, self._host,
                                            self._configs, self.registry)
        return self.metrics_server.port

    def interceptors(self) -> list[Any]:
        """For a threaded grpc.server: call metrics outermost, then the RPC's span."""
        tracing = self.tracing.server_interceptor()
        return [self.grpc_metrics.interceptor(), *([tracing] if tracing else [])]

    def aio_interceptors(self) -> list[Any]:
        tracing = self.tracing.aio_server_interceptor()
        return [self.grpc_metrics.aio_interceptor(), *([tracing] if tracing else [])]

    def shutdown(self) -> None:
        self.tracing.shutdown()
        if self.metrics_server is not None:
            self.metrics_server.stop()
