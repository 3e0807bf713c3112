"""Throwaway certificates for local mTLS (`corestream serve --tls-auto`).

One self-signed CA signs one certificate per name, each valid for 127.0.0.1 and
localhost and usable both as a server and as a client certificate, so that every
process of a local cluster can prove who it is to the others. Keys are EC P-256
and are written readable by the owner only. Not for production: real deployments
bring certificates from their own CA (e.g. cert-manager).
"""

from __future__ import annotations

import datetime
import ipaddress
import os
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from services.common.security_config import SecurityConfig

VALIDITY = datetime.timedelta(days=7)
# Clocks of the processes that check the certificates may lag a little.
_BACKDATE = datetime.timedelta(minutes=5)


@dataclass(frozen=True)
class Authority:
    """A CA that can sign certificates."""

    key: ec.EllipticCurvePrivateKey
    cert: x509.Certificate


def _name(common_name: str) -> x509.Name:
    return x509.Name([
        x509.NameAttribute(NameOID.ORGANIZATION_NAME, "corestream (local)"),
        x509.NameAttribute(NameOID.COMMON_NAME, common_name),
    ])


def _builder(subject: x509.Name, issuer: x509.Name, public_key: ec.EllipticCurvePublicKey
             ) -> x509.CertificateBuilder:
    now = datetime.datetime.now(datetime.UTC)
    return (x509.CertificateBuilder()
            .subject_name(subject).issuer_name(issuer).public_key(public_key)
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - _BACKDATE).not_valid_after(now + VALIDITY))


def make_authority(common_name: str = "corestream local CA") -> Authority:
    key = ec.generate_private_key(ec.SECP256R1())
    name = _name(common_name)
    cert = (_builder(name, name, key.public_key())
            .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
            .add_extension(x509.KeyUsage(
                digital_signature=True, key_cert_sign=True, crl_sign=True,
                content_commitment=False, key_encipherment=False, data_encipherment=False,
                key_agreement=False, encipher_only=False, decipher_only=False), critical=True)
            .sign(key, hashes.SHA256()))
    return Authority(key, cert)


def issue(ca: Authority, common_name: str, hosts: tuple[str, ...] = ("127.0.0.1", "localhost")
          ) -> tuple[x509.Certificate, ec.EllipticCurvePrivateKey]:
    """A certificate for `hosts` (IP addresses or DNS names), for servers and clients."""
    key = ec.generate_private_key(ec.SECP256R1())
    names: list[x509.GeneralName] = []
    for host in hosts:
        try:
            names.append(x509.IPAddress(ipaddress.ip_address(host)))
        except ValueError:
            names.append(x509.DNSName(host))
    cert = (_builder(_name(common_name), ca.cert.subject, key.public_key())
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(x509.SubjectAlternativeName(names), critical=False)
            .add_extension(x509.ExtendedKeyUsage(
                [ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]),
                critical=False)
            .sign(ca.key, hashes.SHA256()))
    return cert, key


def _pem(cert: x509.Certificate) -> bytes:
    return cert.public_bytes(serialization.Encoding.PEM)


def _write_private(path: Path, data: bytes) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(data)


def write_local_pki(directory: Path, names: tuple[str, ...]) -> dict[str, SecurityConfig]:
    """A fresh CA (ca.pem) and, per name, NAME.pem and NAME.key in `directory`; returns
    each name's SecurityConfig (mTLS with that certificate)."""
    directory.mkdir(parents=True, exist_ok=True)
    ca = make_authority()
    ca_path = directory / "ca.pem"
    ca_path.write_bytes(_pem(ca.cert))
    configs: dict[str, SecurityConfig] = {}
    for name in names:
        cert, key = issue(ca, name)
        cert_path, key_path = directory / f"{name}.pem", directory / f"{name}.key"
        cert_path.write_bytes(_pem(cert))
        _write_private(key_path, key.private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption()))
        configs[name] = SecurityConfig(
            tls_cert=str(cert_path), tls_key=str(key_path), tls_ca=str(ca_path))
    return configs
