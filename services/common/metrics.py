"""Prometheus metrics shared by every service: registry, /metrics endpoint, config info.

Names: where a metric means what a vLLM metric means it has vLLM's name with our
prefix (`vllm:time_to_first_token_seconds` -> `corestream:time_to_first_token_seconds`)
and vLLM's labels (`model_name`, `engine`), so a dashboard or autoscaler written
for vLLM changes only the prefix. Labels never carry request ids.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Iterable, Iterator, Sequence
from typing import Any

from prometheus_client import (
    GC_COLLECTOR,
    PLATFORM_COLLECTOR,
    PROCESS_COLLECTOR,
    CollectorRegistry,
    start_http_server,
)
from prometheus_client.core import InfoMetricFamily, Metric
from prometheus_client.exposition import choose_encoder
from prometheus_client.registry import Collector

from services.common.observability_config import ObservabilityConfig
from services.common.ports import unavailable

log = logging.getLogger(__name__)

PREFIX = "corestream:"
# Config fields whose values are never shown.
_SECRET_WORDS = ("key", "token", "password", "secret")

# Seconds; vLLM's buckets for the same histograms, so quantiles line up.
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0,
                2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5,
               5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
REQUEST_LATENCY_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0,
                           40.0, 50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)


def new_registry(process_metrics: bool = True) -> CollectorRegistry:
    """A registry of one's own (tests build many); with the process, platform and GC
    collectors that the default registry would have."""
    registry = CollectorRegistry(auto_describe=True)
    if process_metrics:
        for collector in (PROCESS_COLLECTOR, PLATFORM_COLLECTOR, GC_COLLECTOR):
            registry.register(collector)
    return registry


class ConfigInfo(Collector):
    """`corestream:config_info{component=..., <field>=<value>...} 1` per config: the
    effective configuration of the process, readable from its metrics endpoint."""

    def __init__(self, service: str, configs: Sequence[Any]) -> None:
        self._service = service
        self._configs = list(configs)

    def collect(self) -> Iterator[Metric]:
        family = InfoMetricFamily(f"{PREFIX}config", "Effective configuration of the process.",
                                  labels=["service", "component"])
        for config in self._configs:
            family.add_metric([self._service, type(config).__name__], config_labels(config))
        yield family


def config_labels(config: Any) -> dict[str, str]:
    labels: dict[str, str] = {}
    for f in dataclasses.fields(config):
        if any(word in f.name for word in _SECRET_WORDS):
            continue
        value = getattr(config, f.name)
        if isinstance(value, tuple | list):
            value = ",".join(map(str, value))
        labels[f.name] = str(value)
    return labels


def exposition(registry: CollectorRegistry, accept: str = "") -> tuple[bytes, str]:
    """(body, content type) of a scrape of `registry`: the Prometheus text format, or
    OpenMetrics when the `Accept` header asks for it, as the metrics port answers."""
    encoder, content_type = choose_encoder(accept)
    return encoder(registry), content_type


class MetricsServer:
    """The process's /metrics endpoint (Prometheus text) on its own HTTP port."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.registry = registry
        self.port = 0
        self._httpd: Any = None

    def start(self, config: ObservabilityConfig, default_host: str) -> int:
        """Listen (a daemon thread) unless --metrics-port is 0; returns the bound port."""
        if not config.metrics_port:
            return 0
        host = config.metrics_host or default_host
        try:
            self._httpd, _ = start_http_server(config.metrics_port, addr=host,
                                               registry=self.registry)
        except OSError as exc:
            raise unavailable(host, config.metrics_port, "--metrics-port", exc) from None
        self.port = int(self._httpd.server_port)
        log.info("metrics on http://%s:%d/metrics", host, self.port)
        return self.port

    def stop(self) -> None:
        if self._httpd is not None:
            self._httpd.shutdown()
            self._httpd.server_close()
            self._httpd = None


def serve_metrics(
    service: str,
    config: ObservabilityConfig,
    default_host: str,
    configs: Iterable[Any],
    registry: CollectorRegistry | None = None,
) -> MetricsServer:
    """Start a process's endpoint with its config info (no-op when the port is 0)."""
    registry = registry if registry is not None else new_registry()
    registry.register(ConfigInfo(service, [*configs, config]))
    server = MetricsServer(registry)
    server.start(config, default_host)
    return server
