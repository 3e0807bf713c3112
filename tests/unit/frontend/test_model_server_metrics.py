"""The server's totals over its engines (model_server_metrics.py), as pickers read them."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from services.frontend.model_server_metrics import (
    EngineCapacities,
    EngineCapacity,
    EngineLoad,
    ServerLoadCollector,
    engine_loads,
    load_families,
    server_load,
)
from services.frontend.routing.balancer import EngineLoadInfo


def test_totals_sum_requests_and_weigh_usage_by_blocks() -> None:
    load = server_load([
        EngineLoad(0, 3, 1, 0.5, EngineCapacity(16, 100)),
        EngineLoad(1, 2, 4, 1.0, EngineCapacity(16, 300)),
    ])
    assert (load.num_running, load.num_waiting) == (5, 5)
    assert load.kv_cache_usage == (0.5 * 100 + 1.0 * 300) / 400
    assert (load.block_size, load.num_blocks) == (16, 400)


def test_unknown_sizes_fall_back_to_the_mean_and_no_engine_is_idle() -> None:
    load = server_load([EngineLoad(0, 1, 0, 0.2, None),
                        EngineLoad(1, 0, 0, 0.4, EngineCapacity(32, 10))])
    assert abs(load.kv_cache_usage - 0.3) < 1e-9
    # No size until every engine's is known (then no cache_config_info is exported):
    # the other engine's 10 blocks alone would be a total too small.
    assert (load.block_size, load.num_blocks) == (0, 0)
    assert not any(f.name.endswith("cache_config_info")
                   for f in load_families("vllm:", "m", load))
    empty = server_load([])
    assert (empty.num_running, empty.kv_cache_usage, empty.block_size) == (0, 0.0, 0)


def test_different_block_sizes_count_tokens_in_the_smallest() -> None:
    load = server_load([EngineLoad(0, 0, 0, 0.0, EngineCapacity(16, 10)),
                        EngineLoad(1, 0, 0, 0.0, EngineCapacity(32, 10))])
    assert (load.block_size, load.num_blocks) == (16, 30)


@dataclass
class _Client:
    address: str
    connected: bool = True
    engine_index: int | None = None
    num_in_flight: int = 0


class _Balancer:
    def __init__(self, rows: list[tuple[_Client, EngineLoadInfo | None]]) -> None:
        self.rows = rows

    @property
    def clients(self) -> list[_Client]:
        return [client for client, _ in self.rows]

    def engine_loads(self) -> list[tuple[_Client, EngineLoadInfo | None]]:
        return self.rows


def _families(registry: CollectorRegistry) -> dict[str, Any]:
    text = generate_latest(registry).decode()
    return {s.name: (s.labels, s.value)
            for f in text_string_to_metric_families(text) for s in f.samples}


def test_snapshot_figures_win_over_in_flight_counts_and_disconnected_engines_drop() -> None:
    balancer: Any = _Balancer([
        (_Client("a", engine_index=1, num_in_flight=9),
         EngineLoadInfo("a", True, True, num_waiting=2, num_running=3, kv_cache_usage=0.25,
                        engine_index=1)),
        (_Client("b", engine_index=0, num_in_flight=4), None),
        (_Client("c", connected=False, num_in_flight=7), None),
    ])
    capacities = EngineCapacities(balancer)
    loads = engine_loads(balancer, capacities)
    assert [(e.engine_index, e.num_running, e.num_waiting) for e in loads] == [
        (0, 4, 0), (1, 3, 2)]
    registry = CollectorRegistry()
    registry.register(ServerLoadCollector("m", balancer, capacities, vllm_names=True))
    found = _families(registry)
    assert found["vllm:num_requests_running"] == ({"model_name": "m"}, 7.0)
    assert found["vllm:num_requests_waiting"] == ({"model_name": "m"}, 2.0)
    assert found["corestream:server_num_requests_running"] == ({"model_name": "m"}, 7.0)
    # No size known yet: no cache_config_info rather than a cache of 0 blocks.
    assert "vllm:cache_config_info" not in found
