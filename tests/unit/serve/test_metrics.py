"""serve's one /metrics endpoint: every process's families merged, each sample labelled
with its process, and a process that does not answer shown as down."""

from __future__ import annotations

from collections.abc import Iterable

from prometheus_client import CollectorRegistry, Counter, generate_latest
from prometheus_client.core import Metric
from prometheus_client.parser import text_string_to_metric_families

from services.serve.metrics import ClusterMetrics


def engine(requests: float) -> CollectorRegistry:
    registry = CollectorRegistry()
    Counter("corestream:prompt_tokens", "Prompt tokens.", registry=registry).inc(requests)
    return registry


def down() -> Iterable[Metric]:
    raise ConnectionRefusedError("restarting")


def test_families_merge_by_name_with_a_process_label() -> None:
    endpoint = CollectorRegistry()
    collector = ClusterMetrics([("engine-0", engine(3).collect), ("engine-1", engine(5).collect),
                                ("frontend", down)])
    endpoint.register(collector)
    text = generate_latest(endpoint).decode()
    collector.close()
    assert text.count("# TYPE corestream:prompt_tokens_total counter") == 1
    samples = {(s.name, tuple(sorted(s.labels.items()))): s.value
               for family in text_string_to_metric_families(text) for s in family.samples}
    assert samples[("corestream:prompt_tokens_total", (("process", "engine-0"),))] == 3
    assert samples[("corestream:prompt_tokens_total", (("process", "engine-1"),))] == 5
    assert samples[("corestream:serve_scrape_up", (("process", "engine-0"),))] == 1
    assert samples[("corestream:serve_scrape_up", (("process", "frontend"),))] == 0
