"""The coordinator's view of the cluster for Prometheus: engines by lifecycle state.

Read from the registry when scraped, so a dashboard sees at once how many engines
are RUNNING, DRAINING or DEAD (an engine whose lease expired is gone from it).
"""

from __future__ import annotations

from collections.abc import Iterator

from corestream.common.v1 import common_pb2
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from services.common.metrics import PREFIX
from services.coordinator.registry import EngineRegistry

_PREFIX = "ENGINE_STATE_"
STATES = [name.removeprefix(_PREFIX) for name, value in common_pb2.EngineState.items() if value]


class CoordinatorCollector(Collector):
    def __init__(self, registry: EngineRegistry) -> None:
        self._registry = registry

    def collect(self) -> Iterator[Metric]:
        counts: dict[tuple[str, str], int] = {}
        models = set()
        for engine in self._registry.snapshot().engines:
            models.add(engine.model)
            name = common_pb2.EngineState.Name(engine.state).removeprefix(_PREFIX)  # type: ignore[arg-type]
            counts[engine.model, name] = counts.get((engine.model, name), 0) + 1
        family = GaugeMetricFamily(PREFIX + "coordinator_engines",
                                   "Engines registered with the coordinator, by state.",
                                   labels=["model_name", "state"])
        for model in sorted(models):
            for state in STATES:
                family.add_metric([model, state], counts.get((model, state), 0))
        yield family
