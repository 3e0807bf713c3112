"""GetLoads from the frontend's load view: one SchedulerLoad per connected engine.

The figures are the coordinator's latest snapshot for each engine (running and
waiting requests, KV-cache usage), what routing itself reads
(routing/balancer.py). Without fresh figures (static --engines, or the coordinator
out of reach) an engine reports this frontend's own requests in flight there as
running and nothing else: exact for a single frontend, and never stale. The KV cache's
size in tokens (`max_total_num_tokens`, and `num_used_tokens` from the usage) comes from
the engines' GetEngineInfo as the frontend last read it (0 until then).
"""

from __future__ import annotations

import datetime
from collections.abc import Callable

from corestream.vendor.smg_grpc_proto import vllm_engine_pb2 as vllm_pb2

from services.frontend.errors import invalid_argument
from services.frontend.routing.balancer import Balancer

KvTokens = Callable[[str], int]
"""An engine's KV-cache size in tokens by its address; 0 when not known."""


def scheduler_loads(balancer: Balancer, dp_rank: int | None = None,
                    kv_tokens: KvTokens = lambda address: 0) -> list[vllm_pb2.SchedulerLoad]:
    """The connected engines' loads in rank order (only `dp_rank`'s when given;
    INVALID_ARGUMENT when no connected engine has it)."""
    loads = []
    for client, load in balancer.engine_loads():
        if not client.connected:
            continue
        rank = load.engine_index if load is not None and load.engine_index is not None \
            else client.engine_index
        if load is not None:
            running, waiting, usage = load.num_running, load.num_waiting, load.kv_cache_usage
        else:
            running, waiting, usage = client.num_in_flight, 0, 0.0
        capacity = kv_tokens(client.address)
        loads.append(vllm_pb2.SchedulerLoad(
            dp_rank=rank or 0, num_running_reqs=running, num_waiting_reqs=waiting,
            num_total_reqs=running + waiting, token_usage=usage,
            max_total_num_tokens=capacity, num_used_tokens=round(usage * capacity)))
    loads.sort(key=lambda s: s.dp_rank)
    if dp_rank is None:
        return loads
    chosen = [s for s in loads if s.dp_rank == dp_rank]
    if not chosen:
        known = ", ".join(str(s.dp_rank) for s in loads) or "none connected"
        raise invalid_argument("dp_rank", f"dp_rank {dp_rank} names no connected engine "
                               f"(ranks: {known})")
    return chosen


def loads_response(balancer: Balancer, version: str, dp_rank: int | None = None,
                   kv_tokens: KvTokens = lambda address: 0) -> vllm_pb2.GetLoadsResponse:
    loads = scheduler_loads(balancer, dp_rank, kv_tokens)
    return vllm_pb2.GetLoadsResponse(
        timestamp=datetime.datetime.now(datetime.UTC).isoformat(), version=version,
        dp_rank_count=len(loads), loads=loads)
