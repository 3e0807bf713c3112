"""serve's one Prometheus endpoint for the whole cluster.

Each process keeps its own /metrics on a private port of 127.0.0.1 that serve chose; on
every scrape of serve's port, serve reads them all at once and answers with one
exposition in which each sample carries `process` ("coordinator", "frontend",
"engine-N", "serve"), so one scrape target covers a cluster whose engines restart on
new pids. A process that does not answer (it is restarting) is left out of that scrape
and shows as `corestream:serve_scrape_up{process} 0`.
"""

from __future__ import annotations

import logging
import urllib.request
from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor

from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.registry import Collector

from services.common.metrics import PREFIX

log = logging.getLogger("services.serve")

Source = tuple[str, Callable[[], Iterable[Metric]]]
"""A process by name, and how to read its metric families (None-free; raises if down)."""


def scrape(port: int, timeout_s: float = 2.0) -> Callable[[], Iterable[Metric]]:
    """Reads the families of the /metrics endpoint on 127.0.0.1:`port`."""

    def read() -> Iterable[Metric]:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics",
                                    timeout=timeout_s) as reply:
            return list(text_string_to_metric_families(reply.read().decode()))

    return read


class ClusterMetrics(Collector):
    """Every source's families, merged by name, each sample labelled with its process."""

    def __init__(self, sources: Sequence[Source]) -> None:
        self._sources = list(sources)
        self._pool = ThreadPoolExecutor(max_workers=max(1, len(self._sources)),
                                        thread_name_prefix="metrics-scrape")

    def collect(self) -> Iterator[Metric]:
        results = list(self._pool.map(_read, self._sources))
        up = GaugeMetricFamily(f"{PREFIX}serve_scrape_up", "Whether serve read the process's "
                               "metrics for this scrape (0: it is starting or restarting).",
                               labels=["process"])
        merged: dict[str, Metric] = {}
        for (process, _), families in zip(self._sources, results, strict=True):
            up.add_metric([process], families is not None)
            for family in families or ():
                target = merged.get(family.name)
                if target is None:
                    target = merged[family.name] = Metric(
                        family.name, family.documentation, family.type, family.unit)
                target.samples.extend(
                    sample._replace(labels={**sample.labels, "process": process})
                    for sample in family.samples)
        yield from merged.values()
        yield up

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


def _read(source: Source) -> list[Metric] | None:
    process, read = source
    try:
        return list(read())
    except OSError as e:  # refused, reset or timed out: the process is not up
        log.debug("metrics of %s unreadable: %s", process, e)
        return None
