"""The coordinator's engines-by-state gauge, read from the real registry at scrape time."""

from __future__ import annotations

from corestream.common.v1 import common_pb2

from services.common.metrics import new_registry
from services.coordinator.metrics import CoordinatorCollector
from services.coordinator.registry import EngineRegistry


def _engines(registry) -> dict[str, float]:
    return {s.labels["state"]: s.value for m in registry.collect()
            if m.name == "corestream:coordinator_engines" for s in m.samples}


def test_engines_by_state_follow_registrations_reports_and_removals() -> None:
    engines = EngineRegistry()
    prometheus = new_registry(process_metrics=False)
    prometheus.register(CoordinatorCollector(engines))
    assert _engines(prometheus) == {}  # no engine, no model yet
    a = engines.register(0, "127.0.0.1:1", "tiny", 512, common_pb2.ENGINE_STATE_RUNNING)
    engines.register(1, "127.0.0.1:2", "tiny", 512, common_pb2.ENGINE_STATE_STARTING)
    assert _engines(prometheus) == {"STARTING": 1, "RUNNING": 1, "DRAINING": 0, "STOPPED": 0,
                                    "DEAD": 0, "PAUSED_FAULT": 0}
    engines.update(a, num_waiting=0, num_running=0, kv_cache_usage=0.0,
                   state=common_pb2.ENGINE_STATE_DEAD, step_counter=3)
    assert _engines(prometheus)["DEAD"] == 1 and _engines(prometheus)["RUNNING"] == 0
    engines.remove(a)
    assert _engines(prometheus)["DEAD"] == 0
