"""Auth, mTLS, the plaintext health port and keepalive against real processes.

One `corestream serve --tls-auto` cluster with API and admin keys serves the auth
and mTLS tests; a lone coordinator (no model, so it starts in a second) serves the
health-port and keepalive tests.
"""

from __future__ import annotations

import ssl
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import httpx
import pytest
from corestream.common.v1 import common_pb2
from corestream.coordinator.v1 import coordinator_service_pb2 as coord_pb
from corestream.coordinator.v1 import coordinator_service_pb2_grpc as coord_grpc
from corestream.engine.v1 import engine_core_service_pb2 as engine_pb
from corestream.engine.v1 import engine_core_service_pb2_grpc as engine_grpc
from corestream.generate.v1 import admin_service_pb2 as admin_pb
from corestream.generate.v1 import admin_service_pb2_grpc as admin_grpc
from corestream.generate.v1 import generate_service_pb2 as pb
from corestream.generate.v1 import generate_service_pb2_grpc as pb_grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from services.common.certs import write_local_pki
from services.common.grpc_server import make_channel
from services.common.security_config import PLAINTEXT, SecurityConfig
from tests.integration.cluster import REPO, Cluster, free_port

pytestmark = pytest.mark.timeout(300)

API_KEYS = ("alpha-7f3e", "beta-91c2")
ADMIN_KEY = "admin-5d1a"
OK = grpc.StatusCode.OK


def bearer(key: str) -> tuple[tuple[str, str], ...]:
    return (("authorization", f"Bearer {key}"),)


@pytest.fixture(scope="module")
def tls_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("tls")


HTTP_PORT = free_port()


@pytest.fixture(scope="module")
def cluster(tls_dir: Path) -> Iterator[Cluster]:
    keys = tls_dir / "api-keys"
    keys.write_text("# test keys\n" + "\n".join(API_KEYS) + "\n")
    admin = tls_dir / "admin-keys"
    admin.write_text(ADMIN_KEY + "\n")
    c = Cluster(["--tls-auto", "--tls-dir", str(tls_dir / "pki"), "--api-key-file", str(keys),
                 "--admin-api-key-file", str(admin), "--max-tokens-limit", "64",
                 "--http-port", str(HTTP_PORT)])
    yield c
    c.stop()


def role(tls_dir: Path, name: str) -> SecurityConfig:
    pki = tls_dir / "pki"
    return SecurityConfig(tls_cert=str(pki / f"{name}.pem"), tls_key=str(pki / f"{name}.key"),
                          tls_ca=str(pki / "ca.pem"))


def no_client_cert(tls_dir: Path) -> grpc.ChannelCredentials:
    return grpc.ssl_channel_credentials((tls_dir / "pki" / "ca.pem").read_bytes())


@pytest.fixture(scope="module")
def channel(cluster: Cluster, tls_dir: Path) -> Iterator[grpc.Channel]:
    with make_channel(cluster.address, role(tls_dir, "client")) as ch:
        yield ch


def generate(channel: grpc.Channel, metadata: tuple[tuple[str, str], ...] = ()
             ) -> tuple[grpc.StatusCode, str]:
    request = pb.GenerateRequest(text="hello", sampling=common_pb2.SamplingParams(
        max_tokens=4, temperature=0.0))
    try:
        response = pb_grpc.GenerateServiceStub(channel).Generate(
            request, metadata=metadata, timeout=30)
    except grpc.RpcError as e:
        return e.code(), e.details() or ""
    assert response.completions[0].token_ids
    return OK, ""


def test_wrong_or_missing_token_is_unauthenticated(channel: grpc.Channel) -> None:
    code, details = generate(channel)
    assert code is grpc.StatusCode.UNAUTHENTICATED and "authorization: Bearer" in details
    code, details = generate(channel, bearer("alpha-7f3f"))
    assert (code, details) == (grpc.StatusCode.UNAUTHENTICATED, "invalid API key")
    code, _ = generate(channel, (("authorization", API_KEYS[0]),))  # no scheme
    assert code is grpc.StatusCode.UNAUTHENTICATED
    for key in (*API_KEYS, ADMIN_KEY):
        assert generate(channel, bearer(key)) == (OK, "")


def test_every_rpc_but_health_needs_a_key(channel: grpc.Channel) -> None:
    stub = pb_grpc.GenerateServiceStub(channel)
    for call, request in ((stub.GetModelInfo, pb.GetModelInfoRequest()),
                          (stub.Tokenize, pb.TokenizeRequest(text="hi")),
                          (stub.Abort, pb.AbortRequest(request_ids=["x"]))):
        with pytest.raises(grpc.RpcError) as info:
            call(request, timeout=10)
        assert info.value.code() is grpc.StatusCode.UNAUTHENTICATED
        call(request, timeout=10, metadata=bearer(API_KEYS[1]))
    # Streaming too, and reflection, which tells a stranger the whole API.
    with pytest.raises(grpc.RpcError) as info:
        list(stub.GenerateStream(pb.GenerateStreamRequest(text="hi"), timeout=10))
    assert info.value.code() is grpc.StatusCode.UNAUTHENTICATED
    reflect = reflection_pb2_grpc.ServerReflectionStub(channel)
    ask = reflection_pb2.ServerReflectionRequest(list_services="")
    with pytest.raises(grpc.RpcError) as info:
        list(reflect.ServerReflectionInfo(iter([ask]), timeout=10))
    assert info.value.code() is grpc.StatusCode.UNAUTHENTICATED
    [answer] = reflect.ServerReflectionInfo(iter([ask]), timeout=10,
                                            metadata=bearer(API_KEYS[0]))
    names = {s.name for s in answer.list_services_response.service}
    assert "corestream.generate.v1.GenerateService" in names
    # Probes carry no credentials.
    reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=10)
    assert reply.status == health_pb2.HealthCheckResponse.SERVING


def test_admin_rpcs_need_the_admin_key(channel: grpc.Channel) -> None:
    stub = admin_grpc.AdminServiceStub(channel)
    request = admin_pb.GetEngineStatsRequest()
    for metadata, code in (((), grpc.StatusCode.UNAUTHENTICATED),
                           (bearer(API_KEYS[0]), grpc.StatusCode.PERMISSION_DENIED),
                           (bearer("nope"), grpc.StatusCode.UNAUTHENTICATED)):
        with pytest.raises(grpc.RpcError) as info:
            stub.GetEngineStats(request, metadata=metadata, timeout=10)
        assert info.value.code() is code
    reply = stub.GetEngineStats(request, metadata=bearer(ADMIN_KEY), timeout=10)
    assert [r.ok for r in reply.results] == [True]


def test_limits_apply_behind_auth(channel: grpc.Channel) -> None:
    request = pb.GenerateRequest(text="hi", sampling=common_pb2.SamplingParams(max_tokens=65))
    with pytest.raises(grpc.RpcError) as info:
        pb_grpc.GenerateServiceStub(channel).Generate(
            request, metadata=bearer(API_KEYS[0]), timeout=10)
    assert info.value.code() is grpc.StatusCode.INVALID_ARGUMENT
    assert "max_tokens_limit" in (info.value.details() or "")


def engine_info(channel: grpc.Channel) -> grpc.StatusCode:
    try:
        engine_grpc.EngineCoreServiceStub(channel).GetEngineInfo(
            engine_pb.GetEngineInfoRequest(), timeout=10)
    except grpc.RpcError as e:
        return e.code()  # type: ignore[no-any-return]
    return OK


def test_missing_client_certificate_is_refused(cluster: Cluster, tls_dir: Path) -> None:
    engine = cluster.engine_addresses[0]
    with make_channel(engine, role(tls_dir, "client")) as ch:
        assert engine_info(ch) is OK  # the engine is up; only the certificate matters
    with grpc.secure_channel(engine, no_client_cert(tls_dir)) as ch:
        assert engine_info(ch) is grpc.StatusCode.UNAVAILABLE
    with grpc.secure_channel(cluster.address, no_client_cert(tls_dir)) as ch:
        assert generate(ch, bearer(API_KEYS[0]))[0] is grpc.StatusCode.UNAVAILABLE
    # A certificate of another CA is no better than none.
    other = write_local_pki(tls_dir / "other", ("client",))["client"]
    stranger = SecurityConfig(tls_cert=other.tls_cert, tls_key=other.tls_key,
                              tls_ca=str(tls_dir / "pki" / "ca.pem"))
    with make_channel(engine, stranger) as ch:
        assert engine_info(ch) is grpc.StatusCode.UNAVAILABLE


def test_http_api_takes_the_grpc_ports_tls_and_keys(cluster: Cluster, tls_dir: Path) -> None:
    pki = tls_dir / "pki"
    base = f"https://127.0.0.1:{HTTP_PORT}"
    body = {"model": "tiny-llama-v2", "prompt": "hello", "max_tokens": 4, "temperature": 0}
    tls = ssl.create_default_context(cafile=str(pki / "ca.pem"))
    tls.load_cert_chain(str(pki / "client.pem"), str(pki / "client.key"))
    with httpx.Client(base_url=base, verify=tls, timeout=30) as http:
        assert http.get("/health").status_code == 200  # probes carry no key
        reply = http.post("/v1/completions", json=body)
        assert reply.status_code == 401 and reply.json()["error"]["type"] == "authentication_error"
        reply = http.post("/v1/completions", json=body,
                          headers={"Authorization": f"Bearer {API_KEYS[1]}"})
        assert reply.status_code == 200, reply.text
        assert reply.json()["usage"]["completion_tokens"] == 4
        # The limits of the gRPC door hold here too.
        reply = http.post("/v1/completions", json={**body, "max_tokens": 65},
                          headers={"Authorization": f"Bearer {API_KEYS[1]}"})
        assert reply.status_code == 400 and "max_tokens_limit" in reply.json()["error"]["message"]
    # No client certificate, or no TLS at all: refused before any HTTP is spoken.
    no_cert = ssl.create_default_context(cafile=str(pki / "ca.pem"))
    with httpx.Client(base_url=base, verify=no_cert, timeout=30) as http, \
            pytest.raises(httpx.TransportError):
        http.get("/health")
    with httpx.Client(base_url=f"http://127.0.0.1:{HTTP_PORT}", timeout=30) as http, \
            pytest.raises(httpx.TransportError):
        http.get("/health")


def test_plaintext_clients_are_refused(cluster: Cluster) -> None:
    with make_channel(cluster.engine_addresses[0], PLAINTEXT) as ch:
        assert engine_info(ch) is grpc.StatusCode.UNAVAILABLE
    with make_channel(cluster.address, PLAINTEXT) as ch:
        assert generate(ch, bearer(API_KEYS[0]))[0] is grpc.StatusCode.UNAVAILABLE
    with make_channel(cluster.coordinator_address, PLAINTEXT) as ch:
        with pytest.raises(grpc.RpcError) as info:
            coord_grpc.CoordinatorServiceStub(ch).ListEngines(
                coord_pb.ListEnginesRequest(), timeout=10)
        assert info.value.code() is grpc.StatusCode.UNAVAILABLE


# ---- a lone coordinator: the plaintext health port and keepalive ----------------


@pytest.fixture(scope="module")
def coordinator(
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[tuple[str, str, SecurityConfig]]:
    """(mTLS address, plaintext health address, client SecurityConfig)."""
    pki = write_local_pki(tmp_path_factory.mktemp("coordinator-pki"), ("server", "client"))
    port, health_port = free_port(), free_port()
    server = pki["server"]
    proc = subprocess.Popen(
        [sys.executable, "-m", "services.cli", "coordinator", "--host", "127.0.0.1",
         "--port", str(port), "--tls-cert", server.tls_cert, "--tls-key", server.tls_key,
         "--tls-ca", server.tls_ca, "--health-host", "127.0.0.1",
         "--health-port", str(health_port)],
        cwd=REPO)
    health_address = f"127.0.0.1:{health_port}"
    try:
        with grpc.insecure_channel(health_address) as ch:
            grpc.channel_ready_future(ch).result(timeout=60)
        yield f"127.0.0.1:{port}", health_address, pki["client"]
    finally:
        proc.terminate()
        proc.wait(30)


def test_health_port_is_plaintext_and_health_only(
        coordinator: tuple[str, str, SecurityConfig]) -> None:
    address, health_address, client = coordinator
    with grpc.insecure_channel(health_address) as ch:
        for service in ("", "readiness", "corestream.coordinator.v1.CoordinatorService"):
            reply = health_pb2_grpc.HealthStub(ch).Check(
                health_pb2.HealthCheckRequest(service=service), timeout=10)
            assert reply.status == health_pb2.HealthCheckResponse.SERVING
        with pytest.raises(grpc.RpcError) as info:
            coord_grpc.CoordinatorServiceStub(ch).ListEngines(
                coord_pb.ListEnginesRequest(), timeout=10)
        assert info.value.code() is grpc.StatusCode.UNIMPLEMENTED
    with grpc.insecure_channel(address) as ch:
        with pytest.raises(grpc.RpcError) as info:
            health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=10)
        assert info.value.code() is grpc.StatusCode.UNAVAILABLE
    with make_channel(address, client) as ch:
        coord_grpc.CoordinatorServiceStub(ch).ListEngines(coord_pb.ListEnginesRequest(),
                                                          timeout=10)


def connectivity_while_pinging(channel: grpc.Channel, seconds: float) -> list[str]:
    """The channel's states from its first call through `seconds` of idle pinging."""
    states: list[str] = []
    channel.subscribe(lambda s: states.append(s.name), try_to_connect=True)
    health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=10)
    time.sleep(seconds)
    return states


def pinging_options(interval_ms: int) -> list[tuple[str, int]]:
    return [("grpc.keepalive_time_ms", interval_ms), ("grpc.keepalive_timeout_ms", 5000),
            ("grpc.keepalive_permit_without_calls", 1), ("grpc.http2.max_pings_without_data", 0)]


def test_polite_pings_are_never_sent_goaway(
        coordinator: tuple[str, str, SecurityConfig]) -> None:
    """A client pinging every second (gRPC clients cannot ping faster; slower is
    politer still), with no calls in between, keeps its connection; a too_many_pings
    GOAWAY would drop the channel from READY to IDLE."""
    address, _, client = coordinator
    with make_channel(address, client, pinging_options(1000)) as ch:
        states = connectivity_while_pinging(ch, 8.0)
    assert states[-1] == "READY" and states.count("READY") == 1, states


def test_a_stricter_server_would_send_goaway() -> None:
    """The check above can fail: a server that allows a ping only every 5 s (what
    our servers allowed before) drops a client pinging every second."""
    from concurrent import futures

    from grpc_health.v1 import health

    from services.common.grpc_server import server_options

    options = [o for o in server_options(1 << 20)
               if o[0] != "grpc.http2.min_ping_interval_without_data_ms"]
    server = grpc.server(futures.ThreadPoolExecutor(2), options=[
        *options, ("grpc.http2.min_ping_interval_without_data_ms", 5000)])
    health_pb2_grpc.add_HealthServicer_to_server(health.HealthServicer(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        with grpc.insecure_channel(f"127.0.0.1:{port}", pinging_options(1000)) as ch:
            states = connectivity_while_pinging(ch, 6.0)
    finally:
        server.stop(0)
    assert "READY" in states and states[-1] != "READY", states


def test_admin_cli_speaks_mtls_and_keys(cluster: Cluster, tls_dir: Path,
                                        capsys: pytest.CaptureFixture[str]) -> None:
    from services.cli.main import main

    client = role(tls_dir, "client")
    tls = ["--tls-cert", client.tls_cert, "--tls-key", client.tls_key, "--tls-ca", client.tls_ca]
    base = ["admin", "--address", cluster.address, "stats", "--timeout", "20"]
    assert main([*base, *tls, "--api-key-file", str(tls_dir / "admin-keys")]) == 0
    assert '"ok": true' in capsys.readouterr().out
    assert main([*base, *tls, "--api-key-file", str(tls_dir / "api-keys")]) == 1
    assert "PERMISSION_DENIED" in capsys.readouterr().err
    assert main([*base, "--api-key-file", str(tls_dir / "admin-keys")]) == 1  # plaintext
    assert "UNAVAILABLE" in capsys.readouterr().err


@pytest.mark.timeout(120)
def test_public_tls_without_client_certificates_and_without_reflection(
        tmp_path: Path) -> None:
    """--no-require-client-cert: TLS for clients that have no certificate (a public
    port); --no-reflection: the API's shape is not served."""
    pki = write_local_pki(tmp_path, ("server",))["server"]
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "services.cli", "coordinator", "--host", "127.0.0.1",
         "--port", str(port), "--tls-cert", pki.tls_cert, "--tls-key", pki.tls_key,
         "--tls-ca", pki.tls_ca, "--no-require-client-cert", "--no-reflection"], cwd=REPO)
    address = f"127.0.0.1:{port}"
    try:
        server_only = grpc.ssl_channel_credentials(Path(pki.tls_ca).read_bytes())
        with grpc.secure_channel(address, server_only) as ch:
            grpc.channel_ready_future(ch).result(timeout=60)
            coord_grpc.CoordinatorServiceStub(ch).ListEngines(
                coord_pb.ListEnginesRequest(), timeout=10)  # no certificate needed
            ask = reflection_pb2.ServerReflectionRequest(list_services="")
            with pytest.raises(grpc.RpcError) as info:
                list(reflection_pb2_grpc.ServerReflectionStub(ch).ServerReflectionInfo(
                    iter([ask]), timeout=10))
            assert info.value.code() is grpc.StatusCode.UNIMPLEMENTED
        with make_channel(address, PLAINTEXT) as ch:  # still TLS only
            with pytest.raises(grpc.RpcError) as info:
                coord_grpc.CoordinatorServiceStub(ch).ListEngines(
                    coord_pb.ListEnginesRequest(), timeout=10)
            assert info.value.code() is grpc.StatusCode.UNAVAILABLE
    finally:
        proc.terminate()
        proc.wait(30)
