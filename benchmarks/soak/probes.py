"""What the soak asks a live cluster: is it serving, what do its engines hold, what do
its metrics say. Plain gRPC and HTTP calls; nothing here changes the cluster's state
but `sweep_kv_pools`, which only sends requests."""

from __future__ import annotations

import json
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import grpc
from corestream.common.v1 import common_pb2
from corestream.generate.v1 import admin_service_pb2 as admin_pb
from corestream.generate.v1 import admin_service_pb2_grpc as admin_grpc
from corestream.generate.v1 import generate_service_pb2 as pb
from corestream.generate.v1 import generate_service_pb2_grpc as pb_grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from prometheus_client.parser import text_string_to_metric_families

from benchmarks.soak.processes import roles
from tests.integration.cluster import Cluster

SWEEP_TOKENS = 256
SWEEP_BLOCK_TOKENS = 16
"""At least the engines' block size (16 by default): a bound on tokens per block."""


def serving(channel: grpc.Channel, engines: int) -> bool:
    """Ready, and each engine answers a request pinned to it."""
    try:
        health = health_pb2_grpc.HealthStub(channel).Check(
            health_pb2.HealthCheckRequest(), timeout=2)
        if health.status != health_pb2.HealthCheckResponse.SERVING:
            return False
        stub = pb_grpc.GenerateServiceStub(channel)
        for rank in range(engines):
            stub.Generate(pb.GenerateRequest(text="ping", data_parallel_rank=rank,
                                             sampling=common_pb2.SamplingParams(max_tokens=1)),
                          timeout=5)
    except grpc.RpcError:
        return False
    return True


def wait_serving(cluster: Cluster, channel: grpc.Channel, engines: int, timeout_s: float,
                 gone: int | None = None) -> float | None:
    """Seconds until every process is back (`gone`, a killed pid, no longer among them)
    and every engine serves; None past the timeout."""
    start = time.monotonic()
    expected = {"coordinator", "frontend", *(f"engine-{i}" for i in range(engines))}
    while time.monotonic() - start < timeout_s:
        live = roles(cluster)
        if expected <= set(live) and gone not in live.values() and serving(channel, engines):
            return time.monotonic() - start
        time.sleep(0.25)
    return None


def engine_stats(channel: grpc.Channel) -> list[dict[str, Any]]:
    reply = admin_grpc.AdminServiceStub(channel).GetEngineStats(
        admin_pb.GetEngineStatsRequest(), timeout=10)
    return [json.loads(r.result_json) if r.ok else {"engine_index": r.engine_index,
                                                     "state": r.message}
            for r in reply.results]


def sweep_kv_pools(channel: grpc.Channel, at_once: int) -> None:
    """Write every KV block of every engine once: the pool is allocated untouched and its
    pages become resident as blocks are first used, which would read as growth after
    the warm levels are taken. Each request has a prompt of its own, so that none
    reuses another's cached blocks; `at_once` must not exceed what an engine lets wait
    (arrivals within one step all wait)."""
    stats = engine_stats(channel)
    # A fresh pool hands out its blocks in order: one pass over all of it touches each.
    rounds = max(int(s["num_blocks"]) * SWEEP_BLOCK_TOKENS // SWEEP_TOKENS + 1
                 for s in stats)
    requests = [pb.GenerateRequest(
        text=f"sweep {s['engine_index']} {i}", data_parallel_rank=s["engine_index"],
        sampling=common_pb2.SamplingParams(max_tokens=SWEEP_TOKENS, ignore_eos=True,
                                           temperature=0.0))
        for i in range(rounds) for s in stats]
    stub = pb_grpc.GenerateServiceStub(channel)
    with ThreadPoolExecutor(at_once) as pool:
        list(pool.map(lambda r: stub.Generate(r, timeout=120), requests))


Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]


def scrape(http_port: int) -> Samples:
    """The HTTP door's /metrics as {(sample name, labels): value}."""
    with urllib.request.urlopen(f"http://127.0.0.1:{http_port}/metrics", timeout=10) as r:
        text = r.read().decode()
    return {(s.name, frozenset(s.labels.items())): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def metric_sum(samples: Samples, name: str) -> float:
    return sum(v for (n, _), v in samples.items() if n == name)


def grpc_in_flight(samples: Samples) -> float:
    """RPCs the frontend started and has not finished."""
    return (metric_sum(samples, "corestream:grpc_server_started_total")
            - metric_sum(samples, "corestream:grpc_server_handled_total"))


def request_counts(before: Samples, after: Samples) -> dict[str, float]:
    """How far the frontend's request counters moved: finished samples, and refused
    requests by code."""
    counts = {"samples finished": metric_sum(after, "corestream:request_success_total")
              - metric_sum(before, "corestream:request_success_total")}
    for key, value in after.items():
        name, labels = key
        delta = value - before.get(key, 0.0)
        if name == "corestream:requests_rejected_total" and delta:
            code = f"rejected {dict(labels)['code']}"
            counts[code] = counts.get(code, 0.0) + delta
    return counts
