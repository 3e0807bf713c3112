"""What an endpoint picker sees of this server: the load of every engine behind the
frontend, per engine and totalled, for its metrics and for SGLang's /v1/loads.

A Kubernetes Gateway API Inference Extension picker (GAIE's EPP, llm-d's) scrapes each
model-server pod it may route to and reads its queue, its running batch and its KV-cache
usage. The pods it routes to are the ones with the HTTP door: frontends. A frontend is
one model server over all the engines it routes to, so it reports their totals: one
series per model, not one per engine (a picker reading per-engine series would see
several values for one pod). Those are `corestream:server_*`; with --vllm-metric-names
also vLLM's names (`vllm:num_requests_waiting`, ...), which pickers read by default.
The engines' own per-engine series (`corestream:num_requests_waiting{engine}`) stay
as they are, on the engines' metrics ports.

Sources: the coordinator's load snapshots, which an engine refreshes within ~100 ms of
a change; without them (static engines, coordinator out of reach) our own in-flight
requests count as running. The KV-cache size (blocks, block size) comes from each
engine's GetEngineInfo, asked again every REFRESH_S (a woken engine may hold a new cache).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Iterator
from dataclasses import dataclass

import grpc
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from services.common.metrics import PREFIX
from services.frontend.routing.balancer import Balancer
from services.frontend.routing.engine_client import EngineClient

log = logging.getLogger(__name__)

REFRESH_S = 5.0
_INFO_TIMEOUT_S = 2.0
VLLM_PREFIX = "vllm:"


@dataclass(frozen=True)
class EngineCapacity:
    block_size: int
    num_blocks: int


@dataclass(frozen=True)
class EngineLoad:
    """One engine as the frontend sees it now."""

    engine_index: int
    """Its data-parallel rank (-1 before it told)."""
    num_running: int
    num_waiting: int
    kv_cache_usage: float
    capacity: EngineCapacity | None
    """None until its GetEngineInfo came back."""


@dataclass(frozen=True)
class ServerLoad:
    """The engines together: what one model-server pod reports."""

    num_running: int
    num_waiting: int
    kv_cache_usage: float
    block_size: int
    """0 while no engine's size is known."""
    num_blocks: int


class EngineCapacities:
    """Each engine's KV-cache size by address, refreshed on the event loop."""

    def __init__(self, balancer: Balancer) -> None:
        self._balancer = balancer
        self._known: dict[str, EngineCapacity] = {}
        self._task: asyncio.Task[None] | None = None

    def get(self, address: str) -> EngineCapacity | None:
        return self._known.get(address)

    def start(self) -> None:
        self._task = asyncio.create_task(self._follow(), name="engine-capacities")

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
            self._task = None

    async def refresh(self) -> None:
        clients = [c for c in self._balancer.clients if c.connected]
        await asyncio.gather(*(self._ask(c) for c in clients))
        live = {c.address for c in self._balancer.clients}
        for address in [a for a in self._known if a not in live]:
            del self._known[address]

    async def _follow(self) -> None:
        while True:
            await self.refresh()
            # Sooner while an engine's size is missing (none known yet: no engine had
            # connected at the first look): a picker reads the size once.
            missing = not self._known or any(c.connected and c.address not in self._known
                                             for c in self._balancer.clients)
            await asyncio.sleep(0.2 if missing else REFRESH_S)

    async def _ask(self, client: EngineClient) -> None:
        try:
            info = await client.get_info(_INFO_TIMEOUT_S)
        except grpc.aio.AioRpcError as e:
            log.debug("GetEngineInfo of %s failed: %s", client.name, e.code().name)
            return
        except Exception as e:
            # A client closed under the call (a retired engine) must not end the follow:
            # the next round asks the engines still there.
            log.debug("GetEngineInfo of %s failed: %r", client.name, e)
            return
        if info.num_kv_blocks and info.block_size:
            self._known[client.address] = EngineCapacity(info.block_size, info.num_kv_blocks)


def engine_loads(balancer: Balancer, capacities: EngineCapacities) -> list[EngineLoad]:
    """The engines that may still hold requests of ours, ordered by rank."""
    loads = []
    for client, figures in balancer.engine_loads():
        if not client.connected:
            continue
        rank = client.engine_index
        if figures is not None:
            rank = figures.engine_index if figures.engine_index is not None else rank
            running, waiting, usage = (figures.num_running, figures.num_waiting,
                                       figures.kv_cache_usage)
        else:
            running, waiting, usage = client.num_in_flight, 0, 0.0
        loads.append(EngineLoad(-1 if rank is None else rank, running, waiting, usage,
                                capacities.get(client.address)))
    return sorted(loads, key=lambda e: e.engine_index)


def server_load(engines: list[EngineLoad]) -> ServerLoad:
    sized = [(e, e.capacity) for e in engines if e.capacity is not None]
    block_size = num_blocks = 0
    # The cache's size only once every engine's is known: a picker reads it once, and an
    # engine that has just connected (serve starts the frontend beside the engines) is
    # asked for its size a moment later; a total of the others' would be too small.
    if sized and len(sized) == len(engines):
        # Engines of one model share a block size; should they not, the smallest
        # counts and the blocks are the same tokens in blocks of that size.
        block_size = min(c.block_size for _, c in sized)
        num_blocks = sum(c.num_blocks * c.block_size for _, c in sized) // block_size
        # Used blocks over all blocks, not a mean of fractions: a big cache weighs more.
        usage = (sum(e.kv_cache_usage * c.num_blocks for e, c in sized)
                 / sum(c.num_blocks for _, c in sized))
    else:
        usage = sum(e.kv_cache_usage for e in engines) / len(engines) if engines else 0.0
    return ServerLoad(num_running=sum(e.num_running for e in engines),
                      num_waiting=sum(e.num_waiting for e in engines),
                      kv_cache_usage=min(usage, 1.0), block_size=block_size,
                      num_blocks=num_blocks)


class ServerLoadCollector(Collector):
    """The totals, read at scrape time, under our names and optionally vLLM's."""

    def __init__(self, model_name: str, balancer: Balancer, capacities: EngineCapacities,
                 vllm_names: bool) -> None:
        self._model_name = model_name
        self._balancer = balancer
        self._capacities = capacities
        self._prefixes = (PREFIX + "server_", *((VLLM_PREFIX,) if vllm_names else ()))

    def collect(self) -> Iterator[Metric]:
        load = server_load(engine_loads(self._balancer, self._capacities))
        for prefix in self._prefixes:
            yield from load_families(prefix, self._model_name, load)


def load_families(prefix: str, model_name: str, load: ServerLoad) -> Iterator[Metric]:
    gauges = [
        ("num_requests_waiting", "Requests waiting to be scheduled, over the engines "
         "behind this server.", load.num_waiting),
        ("num_requests_running", "Requests in the engines' running batches.",
         load.num_running),
        ("kv_cache_usage_perc", "Fraction of the engines' KV-cache blocks in use (1 = full).",
         load.kv_cache_usage),
    ]
    if prefix == VLLM_PREFIX:
        # Pickers from before vLLM's rename read the old name.
        gauges.append(("gpu_cache_usage_perc", "Fraction of the engines' KV-cache blocks "
                       "in use (1 = full); vLLM's name before kv_cache_usage_perc.",
                       load.kv_cache_usage))
    for name, doc, value in gauges:
        family = GaugeMetricFamily(prefix + name, doc, labels=["model_name"])
        family.add_metric([model_name], value)
        yield family
    if prefix == VLLM_PREFIX:
        # No adapters are served: pickers with LoRA affinity (GAIE's) find none loaded
        # here, and no room for any, instead of a missing metric. The value is the time
        # of the figures, which pickers use to pick the latest series.
        lora = GaugeMetricFamily(
            prefix + "lora_requests_info", "LoRA adapters running and waiting (none: no "
            "adapters are served); the value is the time of the figures.",
            labels=["max_lora", "running_lora_adapters", "waiting_lora_adapters"])
        lora.add_metric(["0", "", ""], time.time())
        yield lora
    if load.block_size:
        info = GaugeMetricFamily(
            prefix + "cache_config_info", "The KV cache of the engines together (value 1): "
            "tokens per block and the number of blocks.",
            labels=["model_name", "block_size", "num_gpu_blocks"])
        info.add_metric([model_name, str(load.block_size), str(load.num_blocks)], 1.0)
        yield info

