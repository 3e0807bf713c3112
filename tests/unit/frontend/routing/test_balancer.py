from __future__ import annotations

import asyncio
import dataclasses
import subprocess
import sys
from collections import Counter
from pathlib import Path

import grpc
import pytest
from corestream.common.v1 import common_pb2

from services.common.block_hash import prompt_block_hashes
from services.frontend.errors import RequestError
from services.frontend.routing.balancer import (
    KV_PRESSURE_THRESHOLD,
    KV_PRESSURE_WEIGHT,
    WAITING_WEIGHT,
    Balancer,
    EngineLoadInfo,
    load_score,
    waiting_cost,
)
from services.frontend.routing.policies import RoutingPolicy
from tests.unit.frontend.fakes import StubClient


def _load(address: str, running: int = 0, waiting: int = 0, kv: float = 0.0,
          rank: int | None = None, routable: bool = True) -> EngineLoadInfo:
    return EngineLoadInfo(address, routable=routable, alive=True, num_waiting=waiting,
                          num_running=running, kv_cache_usage=kv, engine_index=rank)


def _picks(balancer: Balancer, count: int, rank: int | None = None) -> list[str]:
    return [balancer.pick(rank).address for _ in range(count)]


def _sends(balancer: Balancer, count: int) -> list[str]:
    """Route `count` requests that stay in flight (unseen ones count while they do)."""
    addresses = []
    for _ in range(count):
        client = balancer.pick()
        client._streams[f"r{len(client._streams)}"] = asyncio.Queue()
        addresses.append(client.address)
    return addresses


def test_score_weights_waiting_more_as_the_kv_cache_fills() -> None:
    assert load_score(_load("a", running=3)) == 3
    assert load_score(_load("a", running=3, waiting=2)) == 3 + 2 * WAITING_WEIGHT
    # No KV pressure below the threshold, then a linear rise to the full penalty.
    assert waiting_cost(0.0) == waiting_cost(KV_PRESSURE_THRESHOLD) == WAITING_WEIGHT
    assert waiting_cost(1.0) == pytest.approx(WAITING_WEIGHT * (1 + KV_PRESSURE_WEIGHT))
    assert WAITING_WEIGHT < waiting_cost(0.9) < waiting_cost(0.95) < waiting_cost(1.0)
    assert load_score(_load("a", waiting=1, kv=0.95)) > load_score(_load("a", waiting=1, kv=0.5))
    # Running requests cost the same whatever the KV usage.
    assert load_score(_load("a", running=4, kv=0.99)) == 4
    # Requests the snapshot does not show yet run at once where nothing waits, and
    # queue (at the waiting cost) where requests already wait.
    assert load_score(_load("a", running=2), num_unseen=3) == 5
    assert load_score(_load("a", waiting=1), num_unseen=1) == 2 * WAITING_WEIGHT


def test_burst_fills_the_idler_engine_counting_unseen_requests() -> None:
    async def main() -> None:
        balancer = Balancer("f", client_factory=StubClient)
        await balancer.update([_load("busy:1", running=6), _load("idle:1")])
        picks = _sends(balancer, 12)
        # The idle engine takes the first 6 until the scores meet, then they alternate.
        assert picks[:6] == ["idle:1"] * 6
        assert Counter(picks) == {"idle:1": 9, "busy:1": 3}
        await balancer.close()

    asyncio.run(main())


def test_kv_pressure_steers_away_from_a_full_cache() -> None:
    async def main() -> None:
        balancer = Balancer("f", client_factory=StubClient)
        # Same counts; one engine's cache is nearly full, so its waiting request costs more.
        await balancer.update([_load("full:1", running=2, waiting=1, kv=0.98),
                               _load("roomy:1", running=2, waiting=1, kv=0.3)])
        assert Counter(_picks(balancer, 4)) == {"roomy:1": 4}
        await balancer.close()

    asyncio.run(main())


def test_equal_scores_rotate() -> None:
    async def main() -> None:
        balancer = Balancer("f", client_factory=StubClient)
        await balancer.set_static(["a:1", "b:1", "c:1"])
        # Static engines route on our own in-flight counts, all zero here: a tie each time.
        assert _picks(balancer, 7) == ["a:1", "b:1", "c:1", "a:1", "b:1", "c:1", "a:1"]
        await balancer.close()

    asyncio.run(main())


def test_snapshots_retire_unseen_counts() -> None:
    async def main() -> None:
        balancer = Balancer("f", client_factory=StubClient)
        snapshot = [_load("a:1"), _load("b:1")]
        await balancer.update(snapshot)
        assert _sends(balancer, 4) == ["a:1", "b:1", "a:1", "b:1"]
        await balancer.update([_load("a:1", running=2), _load("b:1")])
        # a: 2 reported + 2 unseen (sent before the latest snapshot) vs b: 2 unseen.
        assert _sends(balancer, 1) == ["b:1"]
        # Two snapshots later the early requests are in the reported load only.
        await balancer.update([_load("a:1", running=2), _load("b:1", running=3)])
        await balancer.update([_load("a:1", running=2), _load("b:1", running=3)])
        assert _sends(balancer, 1) == ["a:1"]
        await balancer.close()

    asyncio.run(main())


def test_unseen_requests_count_only_while_in_flight() -> None:
    async def main() -> None:
        balancer = Balancer("f", client_factory=StubClient)
        await balancer.update([_load("a:1"), _load("b:1", running=1)])
        # Sequential requests that finish at once: a stays the idler engine.
        assert _picks(balancer, 3) == ["a:1"] * 3
        await balancer.close()

    asyncio.run(main())


def test_pinned_rank_and_its_errors() -> None:
    async def main() -> None:
        balancer = Balancer("f", client_factory=StubClient)
        await balancer.update([_load("a:1", rank=0), _load("b:1", running=50, rank=1),
                               _load("c:1", rank=2, routable=False)])
        assert _picks(balancer, 3, rank=1) == ["b:1"] * 3  # pinned beats the least loaded
        with pytest.raises(RequestError) as info:
            balancer.pick(7)
        assert info.value.code == grpc.StatusCode.INVALID_ARGUMENT
        assert info.value.field == "data_parallel_rank"
        assert "known ranks: 0, 1, 2" in info.value.message
        with pytest.raises(RequestError) as info:
            balancer.pick(2)  # draining
        assert info.value.code == grpc.StatusCode.UNAVAILABLE
        assert "data_parallel_rank 2" in info.value.message
        await balancer.update([_load("a:1", rank=0)])  # rank 1 left the cluster
        with pytest.raises(RequestError) as info:
            balancer.pick(1)
        assert info.value.code == grpc.StatusCode.UNAVAILABLE
        await balancer.close()

    asyncio.run(main())


def test_degraded_routes_on_own_counts_over_known_engines() -> None:
    async def main() -> None:
        balancer = Balancer("f", client_factory=StubClient)
        await balancer.update([_load("a:1", running=9), _load("b:1", running=0)])
        assert not balancer.degraded
        balancer.set_degraded("coordinator lost")
        assert balancer.degraded
        # The stale snapshot no longer counts; our own in-flight requests do.
        balancer._clients["b:1"]._streams.update({"x": asyncio.Queue()})
        assert _picks(balancer, 2) == ["a:1", "a:1"]
        # A snapshot ends the degraded state.
        await balancer.update([_load("a:1", running=9), _load("b:1", running=1)])
        assert not balancer.degraded and balancer.pick().address == "b:1"
        await balancer.close()

    asyncio.run(main())


def test_update_without_retire_keeps_missing_engines() -> None:
    async def main() -> None:
        balancer = Balancer("f", client_factory=StubClient)
        await balancer.update([_load("a:1"), _load("b:1")])
        await balancer.update([_load("b:1")], retire=False)  # a has not re-registered yet
        assert {c.address for c in balancer.clients} == {"a:1", "b:1"}
        assert set(_picks(balancer, 2)) == {"a:1", "b:1"}
        await balancer.update([_load("b:1")])
        assert {c.address for c in balancer.clients} == {"b:1"}
        await balancer.close()

    asyncio.run(main())


def test_tensor_parallel_size_is_the_largest_told() -> None:
    async def main() -> None:
        balancer = Balancer("f", client_factory=StubClient)
        assert balancer.tensor_parallel_size == 0  # no snapshot yet
        await balancer.update([_load("old:1")])  # an engine too old to tell it
        assert balancer.tensor_parallel_size == 0
        await balancer.update([
            _load("old:1"),
            dataclasses.replace(_load("a:1"), tensor_parallel_size=2),
            dataclasses.replace(_load("b:1"), tensor_parallel_size=4),
            EngineLoadInfo("dead:1", routable=False, alive=False, tensor_parallel_size=8),
        ])
        assert balancer.tensor_parallel_size == 4
        await balancer.set_static(["s:1"])
        assert balancer.tensor_parallel_size == 0
        await balancer.close()

    asyncio.run(main())


def test_the_sessions_word_on_the_engines_state_beats_an_older_snapshot() -> None:
    """An engine back from a fault tells its Session at once; the coordinator's snapshot
    follows a report later. A request pinned to it in between is routed, and one pinned to
    an engine whose Session says it paused is refused whatever the snapshot says."""
    async def main() -> None:
        balancer = Balancer("f", client_factory=StubClient)
        await balancer.update([_load("a:1", rank=0), _load("b:1", rank=1, routable=False)])
        with pytest.raises(RequestError) as info:
            balancer.pick(1)  # nothing from b's Session yet: the snapshot decides
        assert info.value.code == grpc.StatusCode.UNAVAILABLE
        b = balancer._clients["b:1"]
        b._state = common_pb2.ENGINE_STATE_RUNNING
        assert _picks(balancer, 2, rank=1) == ["b:1"] * 2
        b._state = common_pb2.ENGINE_STATE_PAUSED_FAULT
        await balancer.update([_load("a:1", rank=0), _load("b:1", rank=1)])
        with pytest.raises(RequestError) as info:
            balancer.pick(1)
        assert info.value.code == grpc.StatusCode.UNAVAILABLE
        assert _picks(balancer, 2) == ["a:1"] * 2
        await balancer.close()

    asyncio.run(main())


def test_vanished_engines_and_readiness() -> None:
    async def main() -> None:
        readiness: list[bool] = []
        balancer = Balancer("f", on_readiness=readiness.append, client_factory=StubClient)
        await balancer.update([_load("a:1"), _load("b:1"), _load("c:1", routable=False)])
        assert readiness == [True]
        assert balancer.pick().address in ("a:1", "b:1")
        # b has a request of ours in flight, so its client stays until it finishes.
        balancer._clients["b:1"]._streams.update({"x": asyncio.Queue()})
        await balancer.update([_load("c:1", routable=False)])
        assert set(balancer._clients) == {"b:1", "c:1"}
        with pytest.raises(RequestError) as info:
            balancer.pick()
        assert info.value.code == grpc.StatusCode.UNAVAILABLE
        # No engine left at all: not ready; one coming back: ready again.
        balancer._clients["b:1"]._streams.clear()
        await balancer.update([])
        assert readiness == [True, False] and not balancer.clients
        await balancer.update([_load("d:1")])
        assert readiness == [True, False, True]
        await balancer.close()
        assert readiness == [True, False, True, False]

    asyncio.run(main())


def test_frontend_never_imports_torch() -> None:
    code = (
        "import sys; import services.frontend.main, services.frontend.server; "
        "assert 'torch' not in sys.modules, 'torch was imported'"
    )
    root = Path(__file__).resolve().parents[4]
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60, cwd=root)


# --- routing policies ------------------------------------------------------------------

BS = 16


def _follow(balancer: Balancer, address: str, held: list[bytes] = ()) -> None:
    """What a client does on its Session's snapshot."""
    assert balancer.prefix_index is not None
    balancer.prefix_index.apply_snapshot(address, f"epoch-{address}", 0, BS, held)


def test_cache_aware_follows_the_prefix_and_spreads_new_ones() -> None:
    async def main() -> None:
        balancer = Balancer("f", client_factory=StubClient, policy=RoutingPolicy.CACHE_AWARE)
        await balancer.update([_load("a:1", running=3), _load("b:1", running=1)])
        system = list(range(1024))
        _follow(balancer, "a:1", prompt_block_hashes(system + [1], BS))
        _follow(balancer, "b:1")
        route = balancer.route(None, system + list(range(5000, 5064)))
        assert route.client.address == "a:1" and route.cached_tokens == 1024
        assert "holds 1024 of 1088" in route.reason
        # A burst on a new prefix: the first goes to the least loaded engine, the rest
        # follow it (its blocks are predicted there) though its load grows.
        other = list(range(2000, 2000 + 512))
        picks = [balancer.route(None, other + [9000 + i] * 8).client.address
                 for i in range(4)]
        assert picks == ["b:1"] * 4
        # The pinned rank wins over the cache.
        await balancer.update([_load("a:1", rank=0, running=3), _load("b:1", rank=1)])
        assert balancer.route(0, other + [1] * 8).client.address == "a:1"
        await balancer.close()
        assert balancer.prefix_index is not None and len(balancer.prefix_index) == 0

    asyncio.run(main())


def test_cache_aware_with_engines_leaving_joining_and_no_coordinator() -> None:
    async def main() -> None:
        balancer = Balancer("f", client_factory=StubClient, policy=RoutingPolicy.CACHE_AWARE)
        index = balancer.prefix_index
        assert index is not None
        await balancer.update([_load("a:1"), _load("b:1", running=1)])
        prompt = list(range(640))
        _follow(balancer, "a:1")
        _follow(balancer, "b:1", prompt_block_hashes(prompt, BS))
        assert balancer.route(None, prompt + [1]).client.address == "b:1"
        # b leaves: it is dropped from the index, and the prompt goes by load.
        await balancer.update([_load("a:1", running=2)])
        assert not index.tracks("b:1")
        route = balancer.route(None, prompt + [2])
        assert route.client.address == "a:1" and route.cached_tokens == 0
        # ... and is now predicted on a. c joins holding another prefix: that one
        # goes to c as soon as c's snapshot is in.
        other = list(range(3000, 3640))
        await balancer.update([_load("a:1", running=2), _load("c:1", running=2)])
        _follow(balancer, "c:1", prompt_block_hashes(other, BS))
        assert balancer.route(None, other + [3]).client.address == "c:1"
        assert balancer.route(None, prompt + [3]).client.address == "a:1"
        # Without the coordinator the load is our own in-flight count; the cache
        # still decides between engines whose loads are close.
        balancer.set_degraded("coordinator lost")
        assert balancer.route(None, other + [4]).client.address == "c:1"
        assert balancer.route(None, prompt + [4]).client.address == "a:1"
        await balancer.close()

    asyncio.run(main())


def test_cache_aware_lets_load_win_when_badly_imbalanced() -> None:
    async def main() -> None:
        balancer = Balancer("f", client_factory=StubClient, policy=RoutingPolicy.CACHE_AWARE)
        await balancer.update([_load("a:1", running=20), _load("b:1", running=2)])
        prompt = list(range(1100))
        _follow(balancer, "a:1", prompt_block_hashes(prompt, BS))
        _follow(balancer, "b:1")
        route = balancer.route(None, prompt)
        assert route.client.address == "b:1" and "imbalance" in route.reason
        await balancer.close()

    asyncio.run(main())


def test_round_robin_ignores_load() -> None:
    async def main() -> None:
        balancer = Balancer("f", client_factory=StubClient, policy=RoutingPolicy.ROUND_ROBIN)
        await balancer.update([_load("a:1", running=30), _load("b:1")])
        assert _picks(balancer, 4) == ["a:1", "b:1", "a:1", "b:1"]
        await balancer.close()

    asyncio.run(main())
