"""What other routers read of a real cluster (`corestream serve`, two engines): the
Gateway API Inference Extension's endpoint pickers (vLLM-named load on the pod's
metrics port, /v1/models, readiness) and SGLang's model gateway (its worker routes).

Load is made to hold still with a keep pause (`frozen`): requests that produced a token
stay running and requests sent afterwards stay waiting, however fast the tiny model is,
so the figures checked are exact, not caught in passing. One cluster serves the module;
the readiness tests run frontends of their own.
"""

from __future__ import annotations

import contextlib
import json
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import grpc
import httpx
import pytest
from corestream.common.v1 import common_pb2
from corestream.engine.v1 import engine_core_service_pb2 as engine_pb2
from corestream.engine.v1 import engine_core_service_pb2_grpc as engine_grpc
from corestream.generate.v1 import admin_service_pb2_grpc as admin_grpc
from corestream.generate.v1 import generate_service_pb2 as pb
from corestream.generate.v1 import generate_service_pb2_grpc as pb_grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from prometheus_client.parser import text_string_to_metric_families

from tests.integration.cluster import REPO, Cluster, free_port, frozen

TIMEOUT_S = 180
MODEL = "tiny-llama-v2"
# Long enough that a request frozen after its first token cannot end first (the tiny
# model's context is 2048 tokens).
LONG = 2000


@pytest.fixture(scope="module")
def cluster() -> Iterator[tuple[Cluster, int, int]]:
    http_port, metrics_port = free_port(), free_port()
    c = Cluster(["--engines", "2", "--max-num-seqs", "1", "--http-port", str(http_port),
                 "--metrics-port", str(metrics_port), "--vllm-metric-names"])
    yield c, http_port, metrics_port
    c.stop()


@pytest.fixture(scope="module")
def http(cluster: tuple[Cluster, int, int]) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=f"http://127.0.0.1:{cluster[1]}", timeout=60) as client:
        yield client


@pytest.fixture(scope="module")
def channel(cluster: tuple[Cluster, int, int]) -> Iterator[grpc.Channel]:
    with grpc.insecure_channel(cluster[0].address) as channel:
        yield channel


def _engine_infos(cluster: Cluster) -> list[engine_pb2.GetEngineInfoResponse]:
    infos = []
    for address in cluster.engine_addresses:
        with grpc.insecure_channel(address) as ch:
            infos.append(engine_grpc.EngineCoreServiceStub(ch).GetEngineInfo(
                engine_pb2.GetEngineInfoRequest(), timeout=10))
    return infos


def _scrape(port: int) -> dict[str, list[tuple[dict[str, str], float]]]:
    text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=10).text
    found: dict[str, list[tuple[dict[str, str], float]]] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            found.setdefault(sample.name, []).append((sample.labels, sample.value))
    return found


def _until(condition: Callable[[], Any], what: str, timeout_s: float = 30) -> Any:
    deadline = time.monotonic() + timeout_s
    while not (value := condition()):
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.05)
    return value


def _gauge(found: dict[str, list[tuple[dict[str, str], float]]], name: str) -> float:
    [(labels, value)] = found[name]  # one series per pod, not one per engine
    assert labels["model_name"] == MODEL
    return value


def _long_request(rank: int | None = None) -> pb.GenerateStreamRequest:
    request = pb.GenerateStreamRequest(
        text="Once upon a time", sampling=common_pb2.SamplingParams(
            max_tokens=LONG, ignore_eos=True, temperature=0.0))
    if rank is not None:
        request.data_parallel_rank = rank
    return request


@pytest.mark.timeout(TIMEOUT_S)
def test_pod_metrics_carry_vllms_names_and_move_with_load(
        cluster: tuple[Cluster, int, int], channel: grpc.Channel) -> None:
    c, _, metrics_port = cluster
    infos = _engine_infos(c)
    found = _until(lambda: (f := _scrape(metrics_port)) and "vllm:cache_config_info" in f and f,
                   "cache_config_info")
    [(labels, value)] = found["vllm:cache_config_info"]
    assert value == 1.0
    assert {info.block_size for info in infos} == {int(labels["block_size"])}
    assert int(labels["num_gpu_blocks"]) == sum(info.num_kv_blocks for info in infos)
    assert found["corestream:server_cache_config_info"][0][0] == labels
    for name in ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc"):
        assert _gauge(found, f"vllm:{name}") == 0.0
        # corestream's own per-engine series stay, one per engine.
        assert len(found[f"corestream:{name}"]) == 2

    stub = pb_grpc.GenerateServiceStub(channel)
    admin = admin_grpc.AdminServiceStub(channel)
    streams = []
    try:
        with frozen(admin, entered=False) as freeze:
            # One request per engine (max-num-seqs 1), each seen running, then frozen.
            for rank in range(2):
                stream = stub.GenerateStream(_long_request(rank), timeout=TIMEOUT_S)
                streams.append(stream)
                next(stream)
            freeze()
            # Two more: admitted by no frozen engine, they wait.
            for rank in range(2):
                streams.append(stub.GenerateStream(_long_request(rank), timeout=TIMEOUT_S))
            loaded = _until(lambda: (f := _scrape(metrics_port))
                            and _gauge(f, "vllm:num_requests_waiting") == 2 and f,
                            "two waiting requests")
            assert _gauge(loaded, "vllm:num_requests_running") == 2
            usage = _gauge(loaded, "vllm:kv_cache_usage_perc")
            assert 0 < usage <= 1 and _gauge(loaded, "vllm:gpu_cache_usage_perc") == usage
            assert _gauge(loaded, "corestream:server_num_requests_waiting") == 2
            # SGLang's gateway reads the same load per engine.
            loads = httpx.get(f"http://127.0.0.1:{cluster[1]}/v1/loads", timeout=10).json()
            assert loads["dp_rank_count"] == 2
            assert sorted(r["dp_rank"] for r in loads["loads"]) == [0, 1]
            assert sum(r["num_running_reqs"] for r in loads["loads"]) == 2
            assert sum(r["num_waiting_reqs"] for r in loads["loads"]) == 2
            for rank in loads["loads"]:
                info = next(i for i in infos if i.engine_index == rank["dp_rank"])
                assert rank["max_total_num_tokens"] == info.num_kv_blocks * info.block_size
                assert rank["num_used_tokens"] > 0
    finally:
        for stream in streams:
            stream.cancel()
    _until(lambda: _gauge(_scrape(metrics_port), "vllm:num_requests_running") == 0
           and _gauge(_scrape(metrics_port), "vllm:num_requests_waiting") == 0, "idle again")


def test_models_give_id_root_and_parent(http: httpx.Client) -> None:
    [model] = http.get("/v1/models").json()["data"]
    assert model["id"] == MODEL and model["parent"] is None
    assert model["root"] and model["object"] == "model"


@pytest.mark.timeout(TIMEOUT_S)
def test_sglang_worker_routes(http: httpx.Client, channel: grpc.Channel) -> None:
    assert http.get("/health").status_code == 200
    assert http.get("/health_generate").status_code == 200
    info = http.get("/server_info").json()
    assert info["dp_size"] == 2 and info["served_model_name"] == MODEL
    assert http.get("/get_model_info").json()["is_generation"] is True
    body = {"text": "Once upon a time",
            "sampling_params": {"max_new_tokens": 12, "temperature": 0}}
    whole = http.post("/generate", json=body).json()
    # The same greedy answer as the gRPC API gives.
    reference = pb_grpc.GenerateServiceStub(channel).Generate(pb.GenerateRequest(
        text=body["text"], sampling=common_pb2.SamplingParams(max_tokens=12, temperature=0.0)),
        timeout=60).completions[0]
    assert whole["text"] == reference.text
    assert whole["output_ids"] == list(reference.token_ids)
    assert whole["meta_info"]["completion_tokens"] == 12
    assert whole["meta_info"]["finish_reason"] == {"type": "length", "length": 12}
    with http.stream("POST", "/generate", json={**body, "stream": True}) as response:
        assert response.status_code == 200
        lines = [line for line in response.iter_lines() if line]
    assert lines[-1] == "data: [DONE]"
    chunks = [json.loads(line.removeprefix("data: ")) for line in lines[:-1]]
    assert chunks[-1]["text"] == reference.text
    assert chunks[-1]["meta_info"]["finish_reason"]["type"] == "length"
    batch = http.post("/generate", json={**body, "text": [body["text"]] * 2}).json()
    assert [item["text"] for item in batch] == [reference.text] * 2


@contextlib.contextmanager
def _frontend(*args: str) -> Iterator[tuple[subprocess.Popen[str], int, int]]:
    """`corestream frontend` on ports of its own; (process, gRPC port, HTTP port)."""
    port, http_port = free_port(), free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "services.cli", "frontend", "--port", str(port),
         "--http-port", str(http_port), "--metrics-port", "0", *args],
        cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines: list[str] = []
    threading.Thread(target=lambda: lines.extend(proc.stdout or ()), daemon=True).start()
    try:
        _until(lambda: _answers(http_port) or proc.poll() is not None, "the frontend's HTTP port")
        assert proc.poll() is None, "".join(lines)
        yield proc, port, http_port
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait()


def _answers(http_port: int) -> bool:
    try:
        httpx.get(f"http://127.0.0.1:{http_port}/health", timeout=2)
    except httpx.TransportError:
        return False
    return True


def _ready(port: int, http_port: int) -> tuple[int, int]:
    """(HTTP /health status, gRPC readiness status) of a frontend."""
    status = httpx.get(f"http://127.0.0.1:{http_port}/health", timeout=5).status_code
    with grpc.insecure_channel(f"127.0.0.1:{port}") as ch:
        readiness = health_pb2_grpc.HealthStub(ch).Check(
            health_pb2.HealthCheckRequest(service="readiness"), timeout=5).status
    return status, readiness


@pytest.mark.timeout(TIMEOUT_S)
def test_not_ready_without_a_warm_engine() -> None:
    # Engines register with the coordinator only once warm: a frontend whose
    # coordinator knows none (here: none there at all) must take no traffic.
    with _frontend("--coordinator", f"127.0.0.1:{free_port()}") as (_, port, http_port):
        time.sleep(1)
        assert _ready(port, http_port) == (503, health_pb2.HealthCheckResponse.NOT_SERVING)


@pytest.mark.timeout(TIMEOUT_S)
def test_not_ready_while_draining(cluster: tuple[Cluster, int, int],
                                  channel: grpc.Channel) -> None:
    c = cluster[0]
    admin = admin_grpc.AdminServiceStub(channel)
    with _frontend("--coordinator", c.coordinator_address,
                   "--shutdown-timeout", "60") as (proc, port, http_port):
        serving = (200, health_pb2.HealthCheckResponse.SERVING)
        _until(lambda: _ready(port, http_port) == serving, "the frontend ready")
        with grpc.insecure_channel(f"127.0.0.1:{port}") as own:
            stub = pb_grpc.GenerateServiceStub(own)
            with frozen(admin, entered=False) as freeze:
                stream = stub.GenerateStream(_long_request(), timeout=TIMEOUT_S)
                next(stream)
                freeze()  # the request stays in flight: the drain must wait for it
                proc.send_signal(signal.SIGTERM)
                _until(lambda: _ready(port, http_port)
                       == (503, health_pb2.HealthCheckResponse.NOT_SERVING), "draining")
                assert proc.poll() is None  # still draining its running request
            # Resumed: the running request ends, and so does the frontend.
            assert len(list(stream)) > 0
        assert proc.wait(60) == 0
