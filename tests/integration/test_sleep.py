"""Sleep and wake through a real cluster (`corestream serve`, two DP engines): level 1
gives each engine's KV cache pages back to the system and wake serves as before; level
2 drops the weights, and an update or a reload brings them back; a sleeping engine
queues requests, stays healthy and is known as sleeping to the coordinator; gRPC,
vLLM's HTTP routes and `corestream admin` all drive it.

The tests share one cluster and run in file order.
"""

from __future__ import annotations

import json
import subprocess
import sys
import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import httpx
import pytest
import torch
from corestream.coordinator.v1 import coordinator_service_pb2 as coord_pb
from corestream.coordinator.v1 import coordinator_service_pb2_grpc as coord_grpc
from corestream.engine.v1 import engine_core_service_pb2 as engine_pb
from corestream.engine.v1 import engine_core_service_pb2_grpc as engine_grpc
from corestream.generate.v1 import admin_service_pb2 as admin_pb
from corestream.generate.v1 import generate_service_pb2 as pb
from grpc_health.v1 import health_pb2, health_pb2_grpc

from tests.integration.cluster import REPO
from tests.integration.faults import wait_for
from tests.integration.rl_cluster import PROMPTS, Setup

pytestmark = pytest.mark.timeout(300)

ENGINE_SERVICE = "corestream.engine.v1.EngineCoreService"


@pytest.fixture(scope="module")
def setup(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Setup]:
    s = Setup(tmp_path_factory.mktemp("sleep"), extra_args=("--kv-cache-memory", "8MiB"))
    s.original = {n: t.clone() for n, t in s.hf.state_dict().items()}  # type: ignore[attr-defined]
    try:
        yield s
    finally:
        s.close()


def _rss(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError(f"no VmRSS for {pid}")


def _fill_kv_cache(setup: Setup, engine: int) -> None:
    """Prefill distinct prompts on `engine` until most of its cache was written once
    (8 MiB: 16384 tokens of the test model's 512 bytes)."""
    gen = torch.Generator().manual_seed(engine)
    prompts = [torch.randint(3, 390, (120,), generator=gen).tolist() for _ in range(150)]

    def prefill(prompt: list[int]) -> None:
        setup.generate.Generate(pb.GenerateRequest(
            token_ids=pb.TokenIds(ids=prompt), data_parallel_rank=engine,
            sampling={"temperature": 0.0, "max_tokens": 1}), timeout=60)

    with ThreadPoolExecutor(8) as pool:
        list(pool.map(prefill, prompts))


def _engine_info(address: str) -> engine_pb.GetEngineInfoResponse:
    with grpc.insecure_channel(address) as channel:
        return engine_grpc.EngineCoreServiceStub(channel).GetEngineInfo(
            engine_pb.GetEngineInfoRequest(), timeout=10)


def _readiness(address: str) -> int:
    with grpc.insecure_channel(address) as channel:
        return health_pb2_grpc.HealthStub(channel).Check(
            health_pb2.HealthCheckRequest(service=ENGINE_SERVICE), timeout=5).status


def _coordinator_levels(setup: Setup) -> list[int]:
    with grpc.insecure_channel(setup.cluster.coordinator_address) as channel:
        reply = coord_grpc.CoordinatorServiceStub(channel).ListEngines(
            coord_pb.ListEnginesRequest(), timeout=5)
    return sorted(e.sleep_level for e in reply.engines)


def _results(reply: admin_pb.SleepResponse | admin_pb.WakeUpResponse) -> list[dict]:
    assert reply.ok, reply
    return [json.loads(r.result_json) for r in reply.results]


def test_level_1_gives_the_cache_back_and_wake_serves_as_before(setup: Setup) -> None:
    setup.expect(setup.hf, "v0")
    for engine in setup.engines:
        _fill_kv_cache(setup, engine)
    pids = [setup.cluster.engine_pid(e) for e in setup.engines]
    before = [_rss(pid) for pid in pids]
    results = _results(setup.admin.Sleep(admin_pb.SleepRequest(level=1), timeout=60))
    after = [_rss(pid) for pid in pids]
    for result, rss_before, rss_after in zip(results, before, after, strict=True):
        assert result["level"] == 1 and result["is_sleeping"]
        resident = result["kv_cache_resident_bytes"]
        assert resident >= 6 << 20, result  # most of the 8 MiB cache was written
        assert rss_before - rss_after >= 0.9 * resident, (rss_before, rss_after, result)

    # Asleep: alive and ready, known as sleeping, and a request waits for the wake.
    assert setup.admin.IsSleeping(admin_pb.IsSleepingRequest()).is_sleeping
    for address in setup.cluster.engine_addresses:
        assert _engine_info(address).sleep_level == 1
        assert _readiness(address) == health_pb2.HealthCheckResponse.SERVING
    wait_for(lambda: _coordinator_levels(setup) == [1, 1], 10, "the coordinator to know")
    tokens: list[int] = []
    stream = threading.Thread(target=lambda: tokens.extend(
        t for c in setup.generate.GenerateStream(pb.GenerateStreamRequest(
            token_ids=pb.TokenIds(ids=PROMPTS[0]), sampling={"temperature": 0.0,
                                                             "max_tokens": 6}), timeout=60)
        for t in c.token_ids))
    stream.start()
    wait_for(lambda: sum(json.loads(r.result_json)["num_waiting"] for r in setup.admin
                         .GetEngineStats(admin_pb.GetEngineStatsRequest()).results) == 1,
             10, "the request to queue")
    assert not tokens

    response = httpx.post(f"http://127.0.0.1:{setup.http_port}/wake_up", timeout=60)
    assert response.status_code == 200, response.text
    assert response.json()["is_sleeping"] is False
    stream.join(60)
    assert len(tokens) == 6
    setup.expect(setup.hf, "v0")
    assert _coordinator_levels(setup) in ([0, 0], [0, 1], [1, 1])  # reports catch up
    wait_for(lambda: _coordinator_levels(setup) == [0, 0], 10, "the coordinator to know")


def test_level_2_then_an_update_then_wake_serves_the_new_weights(setup: Setup) -> None:
    base = f"http://127.0.0.1:{setup.http_port}"
    response = httpx.post(base + "/sleep", params={"level": 2}, timeout=60)
    assert response.status_code == 200, response.text
    assert all(e["weights_bytes"] > 0 for e in response.json()["engines"])
    assert httpx.get(base + "/is_sleeping", timeout=30).json()["is_sleeping"] is True
    folder, model = setup.perturb("v1")
    reply = setup.admin.UpdateWeightsFromDisk(admin_pb.UpdateWeightsFromDiskRequest(
        path=str(folder), weight_version="v1"), timeout=120)
    assert reply.ok, reply
    # The update brought the weights back; the cache is still freed.
    levels = [e["level"] for e in httpx.get(base + "/is_sleeping", timeout=30).json()["engines"]]
    assert levels == [1, 1]
    response = httpx.post(base + "/wake_up", params=[("tags", "kv_cache")], timeout=60)
    assert response.status_code == 200, response.text
    setup.expect(model, "v1")


def test_level_2_then_wake_reloads_the_served_checkpoint(setup: Setup) -> None:
    _results(setup.admin.Sleep(admin_pb.SleepRequest(level=2), timeout=60))
    woken = _results(setup.admin.WakeUp(admin_pb.WakeUpRequest(tags=["weights"]), timeout=120))
    assert all(w["weight_version"] == "v0" and w["level"] == 1 for w in woken), woken
    assert all(w["reloaded_from"].endswith("v0") for w in woken)
    woken = _results(setup.admin.WakeUp(admin_pb.WakeUpRequest(), timeout=60))
    assert all(w["level"] == 0 for w in woken)
    setup.hf.load_state_dict(setup.original)  # type: ignore[attr-defined]
    setup.expect(setup.hf, "v0")


def test_bad_sleep_calls_are_refused_with_the_reason(setup: Setup) -> None:
    for call in (lambda: setup.admin.Sleep(admin_pb.SleepRequest(level=3)),
                 lambda: setup.admin.WakeUp(admin_pb.WakeUpRequest(tags=["kv"]))):
        with pytest.raises(grpc.RpcError) as info:
            call()
        assert info.value.code() is grpc.StatusCode.INVALID_ARGUMENT
    response = httpx.post(f"http://127.0.0.1:{setup.http_port}/sleep",
                          params={"level": "deep"}, timeout=30)
    assert response.status_code == 400 and "level" in response.text


def test_corestream_admin_sleeps_and_wakes(setup: Setup) -> None:
    def admin(*args: str) -> list[dict]:
        run = subprocess.run([sys.executable, "-m", "services.cli", "admin",
                              "--address", setup.cluster.address, *args],
                             capture_output=True, text=True, timeout=60, cwd=REPO)
        assert run.returncode == 0, run.stderr
        return json.loads(run.stdout)

    assert all(r["result"]["level"] == 1 for r in admin("sleep", "--level", "1"))
    assert all(r["result"]["is_sleeping"] for r in admin("is-sleeping"))
    assert all(r["result"]["level"] == 0 for r in admin("wake-up", "--tags", "kv_cache"))
    setup.expect(setup.hf, "v0")
