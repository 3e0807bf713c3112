"""Listen addresses: IPv6 literals must reach gRPC in brackets."""

from __future__ import annotations

import socket
import subprocess
import sys

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from services.common.grpc_server import host_port
from tests.integration.cluster import REPO, free_port


def test_host_port_brackets_ipv6_literals_only() -> None:
    assert host_port("127.0.0.1", 50051) == "127.0.0.1:50051"
    assert host_port("localhost", 1) == "localhost:1"
    assert host_port("::1", 50051) == "[::1]:50051"
    assert host_port("fd00::7", 8) == "[fd00::7]:8"
    assert host_port("[::1]", 9) == "[::1]:9"


def _has_ipv6_loopback() -> bool:
    try:
        with socket.socket(socket.AF_INET6) as s:
            s.bind(("::1", 0))
        return True
    except OSError:
        return False


@pytest.mark.timeout(90)
@pytest.mark.skipif(not _has_ipv6_loopback(), reason="this host has no IPv6 loopback")
def test_a_service_listens_on_an_ipv6_host() -> None:
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "services.cli", "coordinator",
                             "--host", "::1", "--port", str(port)], cwd=REPO)
    try:
        with grpc.insecure_channel(f"[::1]:{port}") as channel:
            grpc.channel_ready_future(channel).result(timeout=60)
            reply = health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service="readiness"), timeout=10)
        assert reply.status == health_pb2.HealthCheckResponse.SERVING
    finally:
        proc.terminate()
        assert proc.wait(30) == 0
