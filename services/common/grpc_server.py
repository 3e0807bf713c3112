"""gRPC server bootstrap shared by every service: options, health, reflection.

Each process serves grpc.health.v1 with a streaming Watch. Probes (Kubernetes'
native gRPC probes among them) ask by service name:

- "" and "liveness": the process answers and is making progress (an engine whose
  watchdog fired or that is DEAD reports NOT_SERVING);
- "startup": SERVING from the first time the process became ready, and stays so,
  so that a long model load is told apart from a later drain;
- "readiness" and each full service name: warm, not draining, not dead, not
  overloaded: send traffic here.

Reflection lists every service so grpcurl needs no proto files.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

MiB = 1024 * 1024

# Public edge: big enough for long prompts as token ids; internal links carry
# batched step outputs, so they get more room.
PUBLIC_MAX_MESSAGE_BYTES = 64 * MiB
INTERNAL_MAX_MESSAGE_BYTES = 256 * MiB

# An engine sends at least this often on a Session that has requests in flight,
# even when no step advanced them, so that a frontend can tell a silent (frozen,
# SIGSTOPped) engine from a slow one.
SESSION_HEARTBEAT_S = 1.0

_KEEPALIVE_OPTIONS: list[tuple[str, Any]] = [
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.min_recv_ping_interval_without_data_ms", 10_000),
    ("grpc.http2.max_pings_without_data", 0),
]


def server_options(max_message_bytes: int) -> list[tuple[str, Any]]:
    return [
        ("grpc.max_receive_message_length", max_message_bytes),
        ("grpc.max_send_message_length", max_message_bytes),
        ("grpc.so_reuseport", 0),
        *_KEEPALIVE_OPTIONS,
    ]


def channel_options(max_message_bytes: int = INTERNAL_MAX_MESSAGE_BYTES) -> list[tuple[str, Any]]:
    return [
        ("grpc.max_receive_message_length", max_message_bytes),
        ("grpc.max_send_message_length", max_message_bytes),
        ("grpc.keepalive_time_ms", 30_000),
        ("grpc.keepalive_timeout_ms", 10_000),
        ("grpc.keepalive_permit_without_calls", 1),
    ]


LIVENESS = "liveness"
READINESS = "readiness"
STARTUP = "startup"
PROBE_SERVICE_NAMES = (LIVENESS, READINESS, STARTUP)


def _status(serving: bool) -> int:
    return (
        health_pb2.HealthCheckResponse.SERVING
        if serving
        else health_pb2.HealthCheckResponse.NOT_SERVING
    )


class Health:
    """Liveness, startup and readiness (see the module doc) of a threaded server."""

    def __init__(self, servicer: health.HealthServicer, service_names: Sequence[str]) -> None:
        self._servicer = servicer
        self._names = [*service_names, READINESS]

    def set_ready(self, ready: bool) -> None:
        for name in self._names:
            self._servicer.set(name, _status(ready))
        if ready:
            self._servicer.set(STARTUP, _status(True))

    def set_live(self, live: bool) -> None:
        for name in ("", LIVENESS):
            self._servicer.set(name, _status(live))

    def shutdown(self) -> None:
        """Tell every watcher NOT_SERVING and refuse further changes."""
        self._servicer.enter_graceful_shutdown()


class AioHealth:
    """The same for an asyncio server, whose health servicer is async."""

    def __init__(self, servicer: Any, service_names: Sequence[str]) -> None:
        self._servicer = servicer
        self._names = [*service_names, READINESS]

    async def set_ready(self, ready: bool) -> None:
        for name in self._names:
            await self._servicer.set(name, _status(ready))
        if ready:
            await self._servicer.set(STARTUP, _status(True))

    async def set_live(self, live: bool) -> None:
        for name in ("", LIVENESS):
            await self._servicer.set(name, _status(live))

    async def shutdown(self) -> None:
        await self._servicer.enter_graceful_shutdown()


def _register(server: Any, servicer: Any, service_names: Sequence[str]) -> None:
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    names = [*service_names, health.SERVICE_NAME, reflection.SERVICE_NAME]
    reflection.enable_server_reflection(names, server)


def add_health_and_reflection(server: grpc.Server, service_names: Sequence[str]) -> Health:
    """Register health and reflection on a threaded server; readiness starts NOT_SERVING."""
    servicer = health.HealthServicer(experimental_non_blocking=True)
    _register(server, servicer, service_names)
    h = Health(servicer, service_names)
    h.set_live(True)
    h.set_ready(False)
    servicer.set(STARTUP, _status(False))
    return h


async def add_aio_health_and_reflection(
    server: grpc.aio.Server, service_names: Sequence[str]
) -> AioHealth:
    """Register health and reflection on an asyncio server; readiness starts NOT_SERVING."""
    servicer = health.aio.HealthServicer()
    _register(server, servicer, service_names)
    h = AioHealth(servicer, service_names)
    await h.set_live(True)
    await h.set_ready(False)
    await servicer.set(STARTUP, _status(False))
    return h
