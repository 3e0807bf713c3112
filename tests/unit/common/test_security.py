"""SecurityConfig, the local PKI, API-key files, the bearer-token check and (m)TLS
binding and dialing over real loopback sockets."""

from __future__ import annotations

import stat
from collections.abc import Iterator
from concurrent import futures
from pathlib import Path

import grpc
import pytest
from cryptography import x509
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from services.common.auth import BearerAuthInterceptor, load_keys
from services.common.certs import write_local_pki
from services.common.grpc_server import bind, make_channel, server_options
from services.common.security_config import PLAINTEXT, SecurityConfig

ROLES = ("server", "client")


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> dict[str, SecurityConfig]:
    return write_local_pki(tmp_path_factory.mktemp("pki"), ROLES)


@pytest.fixture(scope="module")
def other_pki(tmp_path_factory: pytest.TempPathFactory) -> dict[str, SecurityConfig]:
    """Certificates from another CA: valid-looking, but not trusted by `pki`."""
    return write_local_pki(tmp_path_factory.mktemp("other"), ROLES)


@pytest.mark.parametrize(("fields", "message"), [
    ({"tls_cert": "c.pem"}, "together"),
    ({"tls_key": "k.pem"}, "together"),
    ({"tls_ca": "ca.pem"}, "needs tls_cert"),
    ({"health_port": 70000}, "health_port"),
    ({"health_port": 8081, "health_host": ""}, "health_host"),
])
def test_config_rejects(fields: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        SecurityConfig(**fields)  # type: ignore[arg-type]


def test_unreadable_files_are_named(tmp_path: Path) -> None:
    config = SecurityConfig(tls_cert=str(tmp_path / "missing.pem"), tls_key="k")
    with pytest.raises(ValueError, match="tls_cert: cannot read"):
        config.read()
    (tmp_path / "junk.pem").write_text("not a certificate")
    with pytest.raises(ValueError, match="not a PEM file"):
        SecurityConfig(tls_cert=str(tmp_path / "junk.pem"), tls_key="k").read()


def test_local_pki(pki: dict[str, SecurityConfig]) -> None:
    ca = x509.load_pem_x509_certificate(Path(pki["server"].tls_ca).read_bytes())
    for role in ROLES:
        config = pki[role]
        assert config.mtls
        cert = x509.load_pem_x509_certificate(Path(config.tls_cert).read_bytes())
        cert.verify_directly_issued_by(ca)
        sans = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
        assert [str(ip) for ip in sans.get_values_for_type(x509.IPAddress)] == ["127.0.0.1"]
        assert sans.get_values_for_type(x509.DNSName) == ["localhost"]
        # Private keys are for the owner alone.
        assert stat.S_IMODE(Path(config.tls_key).stat().st_mode) == 0o600


def test_load_keys(tmp_path: Path) -> None:
    path = tmp_path / "keys"
    path.write_text("# production keys\n\n  alpha-1  \n#beta\nbeta-2\n")
    assert load_keys(str(path)) == (b"alpha-1", b"beta-2")
    path.write_text("# nothing\n\n")
    with pytest.raises(ValueError, match="holds no key"):
        load_keys(str(path))
    path.write_text("two words\n")
    with pytest.raises(ValueError, match="whitespace"):
        load_keys(str(path))
    with pytest.raises(ValueError, match="api_key_file: cannot read"):
        load_keys(str(tmp_path / "absent"))


GENERATE = "/corestream.generate.v1.GenerateService/Generate"
ADMIN = "/corestream.generate.v1.AdminService/GetEngineStats"
REFLECTION = "/grpc.reflection.v1alpha.ServerReflection/ServerReflectionInfo"
HEALTH = "/grpc.health.v1.Health/Check"
UNAUTHENTICATED = grpc.StatusCode.UNAUTHENTICATED


def bearer(key: str) -> tuple[tuple[str, str]]:
    return (("authorization", f"Bearer {key}"),)


def test_bearer_check() -> None:
    auth = BearerAuthInterceptor([b"k1", b"k2"], [b"adm"],
                                 admin_services=["corestream.generate.v1.AdminService"])
    assert auth.check(HEALTH, ()) is None  # probes carry no credentials
    assert auth.check(GENERATE, bearer("k2")) is None
    assert auth.check(GENERATE, (("authorization", "bearer k1"),)) is None
    assert auth.check(GENERATE, bearer("adm")) is None  # an admin key is an API key too
    assert auth.check(ADMIN, bearer("adm")) is None
    assert auth.check(GENERATE, ())[0] is UNAUTHENTICATED  # type: ignore[index]
    assert auth.check(GENERATE, bearer("k3"))[0] is UNAUTHENTICATED  # type: ignore[index]
    assert auth.check(GENERATE, bearer("k"))[0] is UNAUTHENTICATED  # type: ignore[index]
    assert auth.check(GENERATE, (("authorization", "k1"),))[0] is UNAUTHENTICATED  # type: ignore[index]
    assert auth.check(GENERATE, bearer("k1é"))[0] is UNAUTHENTICATED  # type: ignore[index]
    assert auth.check(REFLECTION, ())[0] is UNAUTHENTICATED  # type: ignore[index]
    assert auth.check(ADMIN, bearer("k1"))[0] is grpc.StatusCode.PERMISSION_DENIED  # type: ignore[index]
    assert auth.check(ADMIN, ())[0] is UNAUTHENTICATED  # type: ignore[index]


def test_admin_open_to_api_keys_without_admin_keys() -> None:
    auth = BearerAuthInterceptor([b"k1"], admin_services=["corestream.generate.v1.AdminService"])
    assert auth.check(ADMIN, bearer("k1")) is None
    assert auth.check(ADMIN, ())[0] is UNAUTHENTICATED  # type: ignore[index]


@pytest.fixture
def tls_server(pki: dict[str, SecurityConfig]) -> Iterator[str]:
    """A real gRPC server (health only) bound with mTLS through `bind`."""
    server = grpc.server(futures.ThreadPoolExecutor(4), options=server_options(1 << 20))
    servicer = health.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    port = bind(server, "127.0.0.1:0", pki["server"])
    server.start()
    yield f"127.0.0.1:{port}"
    server.stop(0)


def check(channel: grpc.Channel) -> grpc.StatusCode:
    try:
        health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5)
    except grpc.RpcError as e:
        return e.code()  # type: ignore[no-any-return]
    return grpc.StatusCode.OK


@pytest.mark.timeout(60)
def test_mtls_bind_and_dial(tls_server: str, pki: dict[str, SecurityConfig],
                            other_pki: dict[str, SecurityConfig]) -> None:
    with make_channel(tls_server, pki["client"]) as channel:
        assert check(channel) is grpc.StatusCode.OK
    # No client certificate, a plaintext client, a certificate of another CA.
    no_cert = grpc.ssl_channel_credentials(Path(pki["client"].tls_ca).read_bytes())
    with grpc.secure_channel(tls_server, no_cert) as channel:
        assert check(channel) is grpc.StatusCode.UNAVAILABLE
    with make_channel(tls_server, PLAINTEXT) as channel:
        assert check(channel) is grpc.StatusCode.UNAVAILABLE
    foreign = SecurityConfig(tls_cert=other_pki["client"].tls_cert,
                             tls_key=other_pki["client"].tls_key, tls_ca=pki["client"].tls_ca)
    with make_channel(tls_server, foreign) as channel:
        assert check(channel) is grpc.StatusCode.UNAVAILABLE
    # The client refuses a server that its CA did not sign.
    with make_channel(tls_server, other_pki["client"]) as channel:
        assert check(channel) is grpc.StatusCode.UNAVAILABLE
