"""GetLoads from the balancer's load view."""

from __future__ import annotations

from dataclasses import dataclass
from typing import cast

import grpc
import pytest

from services.frontend.errors import RequestError
from services.frontend.routing.balancer import Balancer, EngineLoadInfo
from services.frontend.vllm_grpc.loads import loads_response, scheduler_loads


@dataclass
class _Client:
    engine_index: int | None
    connected: bool = True
    num_in_flight: int = 0
    address: str = ""


@dataclass
class _Balancer:
    loads: list[tuple[_Client, EngineLoadInfo | None]]

    def engine_loads(self) -> list[tuple[_Client, EngineLoadInfo | None]]:
        return self.loads


def balancer(*loads: tuple[_Client, EngineLoadInfo | None]) -> Balancer:
    return cast(Balancer, _Balancer(list(loads)))


def test_coordinator_figures_per_rank_in_rank_order() -> None:
    view = balancer(
        (_Client(1, address="b"), EngineLoadInfo("b", True, True, num_waiting=2,
                                                 num_running=3, kv_cache_usage=0.5,
                                                 engine_index=1)),
        (_Client(0, address="a"), EngineLoadInfo("a", True, True, num_running=1,
                                                 engine_index=0)),
        (_Client(2, connected=False), None))
    loads = scheduler_loads(view)
    assert [(s.dp_rank, s.num_running_reqs, s.num_waiting_reqs, s.num_total_reqs,
             s.token_usage) for s in loads] == [(0, 1, 0, 1, 0.0), (1, 3, 2, 5, 0.5)]
    assert {s.max_total_num_tokens for s in loads} == {0}  # sizes not known (yet)
    sized = scheduler_loads(view, kv_tokens={"a": 1000, "b": 4096}.__getitem__)
    assert [(s.max_total_num_tokens, s.num_used_tokens) for s in sized] == [
        (1000, 0), (4096, 2048)]
    (only,) = scheduler_loads(view, dp_rank=1)
    assert only.num_waiting_reqs == 2
    response = loads_response(view, "corestream test")
    assert response.dp_rank_count == 2 and response.version == "corestream test"
    assert "T" in response.timestamp  # ISO 8601


def test_without_figures_our_requests_in_flight_are_the_load() -> None:
    (load,) = scheduler_loads(balancer((_Client(0, num_in_flight=4), None)))
    assert (load.num_running_reqs, load.num_waiting_reqs, load.token_usage) == (4, 0, 0.0)


def test_an_unknown_rank_is_invalid() -> None:
    with pytest.raises(RequestError) as info:
        scheduler_loads(balancer((_Client(0), None)), dp_rank=3)
    assert info.value.code is grpc.StatusCode.INVALID_ARGUMENT
    assert info.value.field == "dp_rank"
