"""SecurityConfig: TLS / mTLS between the services and the plaintext health port.

The same three PEM files serve both directions: `tls_cert` + `tls_key` make this
process a TLS server and, when it dials another service, its client identity;
`tls_ca` is the trust root for the peer's certificate either way, so with it the
server requires and verifies client certificates (mTLS) and the client verifies
the server. Every service takes these flags (`corestream <service> --tls-cert ...`).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from services.common.config import doc


@dataclass(frozen=True)
class SecurityConfig:
    tls_cert: str = doc(
        "PEM certificate (chain) of this service; with --tls-key it serves TLS and is the "
        "client certificate it presents to other services.", default=""
    )
    tls_key: str = doc("PEM private key of --tls-cert.", default="")
    tls_ca: str = doc(
        "PEM CA bundle: with it the server requires client certificates signed by it (mTLS) "
        "and outgoing connections use TLS and verify the peer against it.", default=""
    )
    require_client_cert: bool = doc(
        "With --tls-ca, require a client certificate signed by it on this service's port. "
        "Turn it off on a frontend whose public clients have none: its port still serves "
        "TLS (pair it with --api-key-file), and it still presents its certificate and "
        "verifies the engines' when it dials them.", default=True
    )
    reflection: bool = doc(
        "Serve gRPC server reflection (grpcurl needs no proto files); turn it off to keep "
        "the API's shape from callers on an open network.", default=True
    )
    health_host: str = doc(
        "Interface of the plaintext health port (see --health-port).", default="0.0.0.0"
    )
    health_port: int = doc(
        "A separate plaintext port serving only grpc.health.v1 (for probes that cannot do "
        "TLS); 0 turns it off.", default=0
    )

    def __post_init__(self) -> None:
        if bool(self.tls_cert) != bool(self.tls_key):
            raise ValueError("tls_cert and tls_key must be given together")
        if self.tls_ca and not self.tls_cert:
            raise ValueError("tls_ca (mTLS) needs tls_cert and tls_key as well")
        if not 0 <= self.health_port <= 65535:
            raise ValueError(f"health_port must be in [0, 65535], got {self.health_port}")
        if self.health_port and not self.health_host:
            raise ValueError("health_host must be set when health_port is")

    @property
    def tls(self) -> bool:
        return bool(self.tls_cert)

    @property
    def mtls(self) -> bool:
        return bool(self.tls_ca)

    def read(self) -> tuple[bytes, bytes, bytes | None]:
        """(certificate chain, private key, CA bundle or None), read from the files."""
        return _read("tls_cert", self.tls_cert), _read("tls_key", self.tls_key), (
            _read("tls_ca", self.tls_ca) if self.tls_ca else None)


def _read(name: str, path: str) -> bytes:
    try:
        data = Path(path).read_bytes()
    except OSError as exc:
        raise ValueError(f"{name}: cannot read {path!r}: {exc.strerror}") from exc
    if b"-----BEGIN " not in data:
        raise ValueError(f"{name}: {path!r} is not a PEM file")
    return data


PLAINTEXT = SecurityConfig()
"""No TLS, no health port: the default of every component."""
