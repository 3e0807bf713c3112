"""Cache-aware routing through real processes: `corestream serve --engines 2` and a
second frontend of its own.

Engines publish their prefix caches on each frontend's Session; a request whose prompt
shares a long prefix with an earlier one must land where that prefix is cached (the
engine reports the hit in usage.cached_tokens), from either frontend, while requests
with new prefixes still spread over both engines.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from concurrent import futures

import grpc
import pytest
from corestream.common.v1 import common_pb2
from corestream.generate.v1 import admin_service_pb2 as admin_pb
from corestream.generate.v1 import admin_service_pb2_grpc as admin_grpc
from corestream.generate.v1 import generate_service_pb2 as pb
from corestream.generate.v1 import generate_service_pb2_grpc as pb_grpc

from services.common.tiny_checkpoint import resolve_model
from tests.integration.cluster import REPO, Cluster, free_port

pytestmark = pytest.mark.timeout(240)

BLOCK = 16
PREFIX = 10 * BLOCK


@pytest.fixture(scope="module")
def cluster() -> Iterator[Cluster]:
    c = Cluster(["--engines", "2"])
    yield c
    c.stop()


@pytest.fixture(scope="module")
def stub(cluster: Cluster) -> Iterator[pb_grpc.GenerateServiceStub]:
    with grpc.insecure_channel(cluster.address) as channel:
        yield pb_grpc.GenerateServiceStub(channel)


def prefix(seed: int) -> list[int]:
    return [3 + (seed * 31 + i * 7) % 300 for i in range(PREFIX)]


def generate(stub: pb_grpc.GenerateServiceStub, prompt: list[int], cache_salt: str = "",
             max_tokens: int = 2) -> pb.GenerateResponse:
    return stub.Generate(pb.GenerateRequest(
        token_ids=pb.TokenIds(ids=prompt), cache_salt=cache_salt,
        sampling=common_pb2.SamplingParams(temperature=0.0, max_tokens=max_tokens,
                                           ignore_eos=True)),
        timeout=60)


def test_requests_sharing_a_prefix_follow_it(stub: pb_grpc.GenerateServiceStub) -> None:
    # Each group's first request computes its prefix somewhere; every later one with the
    # same prefix (and a different tail) must find it cached. Under least_load, two idle
    # engines would take turns and half of these would miss.
    for group in range(4):
        assert generate(stub, prefix(group) + [1, 2]).usage.cached_tokens == 0
        for tail in range(3):
            usage = generate(stub, prefix(group) + [5 + tail] * 3).usage
            assert usage.cached_tokens == PREFIX, (group, tail)
    # Another salt shares nothing: no block of this prefix exists under it.
    assert generate(stub, prefix(0) + [9], cache_salt="tenant-b").usage.cached_tokens == 0


def test_new_prefixes_spread_over_both_engines(cluster: Cluster,
                                               stub: pb_grpc.GenerateServiceStub) -> None:
    # A burst of prompts nobody holds goes by load: requests in flight spread it.
    before = _prefix_queries(cluster)
    with futures.ThreadPoolExecutor(8) as pool:
        list(pool.map(lambda group: generate(stub, prefix(group), max_tokens=16),
                      range(10, 18)))
    after = _prefix_queries(cluster)
    added = [(after[e] - before.get(e, 0)) // PREFIX for e in after]
    assert len(added) == 2 and min(added) >= 2, added


def test_a_second_frontend_routes_by_the_same_caches(cluster: Cluster) -> None:
    # Started after the prefixes were cached: its Sessions begin with the engines'
    # snapshots, so its first request with a known prefix already goes to the right engine.
    port = free_port()
    frontend = subprocess.Popen(
        [sys.executable, "-m", "services.cli", "frontend", "--model", str(resolve_model(None)),
         "--port", str(port), "--coordinator", cluster.coordinator_address],
        cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1"})
    try:
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            second = pb_grpc.GenerateServiceStub(channel)
            _wait_for_engines(second, 2)
            for group in range(4):
                assert generate(second, prefix(group) + [77]).usage.cached_tokens == PREFIX
    finally:
        frontend.terminate()
        frontend.wait(30)


def test_a_cleared_cache_is_not_predicted(cluster: Cluster,
                                          stub: pb_grpc.GenerateServiceStub) -> None:
    with grpc.insecure_channel(cluster.address) as channel:
        reply = admin_grpc.AdminServiceStub(channel).ResetPrefixCache(
            admin_pb.ResetPrefixCacheRequest(), timeout=30)
    assert all(r.ok for r in reply.results), reply
    # Both engines' caches are empty now and they said so: the index predicts nothing,
    # so the request goes by load and computes its prefix again.
    assert generate(stub, prefix(1) + [5, 5, 5]).usage.cached_tokens == 0
    assert generate(stub, prefix(1) + [6, 6, 6]).usage.cached_tokens == PREFIX


def _prefix_queries(cluster: Cluster) -> dict[int, int]:
    import json

    with grpc.insecure_channel(cluster.address) as channel:
        reply = admin_grpc.AdminServiceStub(channel).GetEngineStats(
            admin_pb.GetEngineStatsRequest(), timeout=30)
    return {r.engine_index: json.loads(r.result_json)["prefix_cache_queries"]
            for r in reply.results}


def _wait_for_engines(stub: pb_grpc.GenerateServiceStub, count: int) -> None:
    import time

    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            if stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=5).num_engines >= count:
                return
        except grpc.RpcError:
            pass
        time.sleep(0.1)
    raise AssertionError("the second frontend never saw both engines")
