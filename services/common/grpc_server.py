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
from concurrent import futures
from typing import Any

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from services.common.ports import port_in_use, unavailable
from services.common.security_config import SecurityConfig
from services.common.thread_names import name_native_thread

MiB = 1024 * 1024

# Internal links carry batched step outputs, so they get more room than the public
# edge, whose limit is the frontend's --max-message-bytes.
INTERNAL_MAX_MESSAGE_BYTES = 256 * MiB
# Health checks are tiny.
_HEALTH_MAX_MESSAGE_BYTES = 64 * 1024

# An engine sends at least this often on a Session that has requests in flight,
# even when no step advanced them, so that a frontend can tell a silent (frozen,
# SIGSTOPped) engine from a slow one.
SESSION_HEARTBEAT_S = 1.0

# Servers ping idle peers every KEEPALIVE_TIME_MS and drop a connection whose ping
# is not answered within KEEPALIVE_TIMEOUT_MS, so a half-open connection (a peer
# that vanished without a FIN) is noticed within their sum. Clients may ping as
# often as every MIN_CLIENT_PING_INTERVAL_MS, with or without calls: half the
# floor of gRPC's own clients (one ping a second), so no gRPC client's keepalive,
# however eager, is refused; only a client pinging faster than that, three times
# in a row, gets GOAWAY "too_many_pings".
KEEPALIVE_TIME_MS = 20_000
KEEPALIVE_TIMEOUT_MS = 10_000
MIN_CLIENT_PING_INTERVAL_MS = 500

_KEEPALIVE_OPTIONS: list[tuple[str, Any]] = [
    ("grpc.keepalive_time_ms", KEEPALIVE_TIME_MS),
    ("grpc.keepalive_timeout_ms", KEEPALIVE_TIMEOUT_MS),
    ("grpc.keepalive_permit_without_calls", 1),
    # The name of GRPC_ARG_HTTP2_MIN_RECV_PING_INTERVAL_WITHOUT_DATA_MS (sic).
    ("grpc.http2.min_ping_interval_without_data_ms", MIN_CLIENT_PING_INTERVAL_MS),
    # Our own keepalive pings go out even on a connection with no calls.
    ("grpc.http2.max_pings_without_data", 0),
]


def server_options(
    max_message_bytes: int, max_concurrent_streams: int = 0,
    max_send_bytes: int = INTERNAL_MAX_MESSAGE_BYTES,
) -> list[tuple[str, Any]]:
    """`max_message_bytes` bounds what a peer may send us; replies may be bigger than
    requests (token lists, logprobs), so they have their own bound. With
    `max_concurrent_streams` one HTTP/2 connection carries at most that many calls."""
    options: list[tuple[str, Any]] = [
        ("grpc.max_receive_message_length", max_message_bytes),
        ("grpc.max_send_message_length", max(max_message_bytes, max_send_bytes)),
        ("grpc.so_reuseport", 0),
        *_KEEPALIVE_OPTIONS,
    ]
    if max_concurrent_streams:
        options.append(("grpc.max_concurrent_streams", max_concurrent_streams))
    return options


RECONNECT_BACKOFF_MS = (100, 2_000)
"""The first and the longest wait between attempts to connect to a peer."""


def channel_options(max_message_bytes: int = INTERNAL_MAX_MESSAGE_BYTES) -> list[tuple[str, Any]]:
    return [
        ("grpc.max_receive_message_length", max_message_bytes),
        ("grpc.max_send_message_length", max_message_bytes),
        ("grpc.keepalive_time_ms", 30_000),
        ("grpc.keepalive_timeout_ms", 10_000),
        ("grpc.keepalive_permit_without_calls", 1),
        # gRPC waits 1 s after a failed connect, then 1.6x longer each time up to 2
        # minutes, failing calls at once meanwhile: a peer that is still starting or was
        # just restarted (serve's supervision, Kubernetes) would be seen seconds late.
        ("grpc.initial_reconnect_backoff_ms", RECONNECT_BACKOFF_MS[0]),
        ("grpc.max_reconnect_backoff_ms", RECONNECT_BACKOFF_MS[1]),
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

    @property
    def servicer(self) -> health.HealthServicer:
        return self._servicer

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

    @property
    def servicer(self) -> Any:
        return self._servicer

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


def _register(server: Any, servicer: Any, service_names: Sequence[str],
              with_reflection: bool) -> None:
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    if with_reflection:
        names = [*service_names, health.SERVICE_NAME, reflection.SERVICE_NAME]
        reflection.enable_server_reflection(names, server)


def add_health_and_reflection(server: grpc.Server, service_names: Sequence[str],
                              with_reflection: bool = True) -> Health:
    """Register health (and reflection) on a threaded server; readiness starts NOT_SERVING."""
    servicer = health.HealthServicer(experimental_non_blocking=True)
    _register(server, servicer, service_names, with_reflection)
    h = Health(servicer, service_names)
    h.set_live(True)
    h.set_ready(False)
    servicer.set(STARTUP, _status(False))
    return h


async def add_aio_health_and_reflection(
    server: grpc.aio.Server, service_names: Sequence[str], with_reflection: bool = True
) -> AioHealth:
    """Register health (and reflection) on an asyncio server; readiness starts NOT_SERVING."""
    servicer = health.aio.HealthServicer()
    _register(server, servicer, service_names, with_reflection)
    h = AioHealth(servicer, service_names)
    await h.set_live(True)
    await h.set_ready(False)
    await servicer.set(STARTUP, _status(False))
    return h


# ---- binding and dialing, plaintext or (m)TLS by SecurityConfig -----------------


def host_port(host: str, port: int) -> str:
    """`host:port` for gRPC, with an IPv6 literal in brackets (`[::1]:50051`)."""
    if ":" in host and not host.startswith("["):
        return f"[{host}]:{port}"
    return f"{host}:{port}"


def server_credentials(security: SecurityConfig) -> grpc.ServerCredentials:
    cert, key, ca = security.read()
    return grpc.ssl_server_credentials(
        [(key, cert)], root_certificates=ca,
        require_client_auth=ca is not None and security.require_client_cert)


def channel_credentials(security: SecurityConfig) -> grpc.ChannelCredentials:
    """This service as a client: verify the peer against tls_ca, present tls_cert."""
    cert, key, ca = security.read()
    return grpc.ssl_channel_credentials(
        root_certificates=ca, private_key=key, certificate_chain=cert)


def bind(server: grpc.Server | grpc.aio.Server, address: str, security: SecurityConfig,
         flag: str = "--port") -> int:
    """Listen on `address` with TLS when `security` has a certificate; returns the bound
    port. PortUnavailable (naming the holder and `flag`) when it cannot be bound."""
    host, _, port_text = address.rpartition(":")
    host, port = host.strip("[]"), int(port_text)
    # Asked first: gRPC's own refusal is a RuntimeError after a C-level log line.
    if port and port_in_use(host, port):
        raise unavailable(host, port, flag)
    try:
        if security.tls:
            bound = server.add_secure_port(address, server_credentials(security))
        else:
            bound = server.add_insecure_port(address)
    except RuntimeError:
        bound = 0
    if bound == 0:
        raise unavailable(host, port, flag)
    return bound


def _dials_tls(security: SecurityConfig) -> bool:
    # Without a CA there is nothing to verify a peer's certificate against.
    return security.mtls


def make_channel(
    address: str, security: SecurityConfig, options: Sequence[tuple[str, Any]] | None = None
) -> grpc.Channel:
    options = list(options if options is not None else channel_options())
    if _dials_tls(security):
        return grpc.secure_channel(address, channel_credentials(security), options=options)
    return grpc.insecure_channel(address, options=options)


def make_aio_channel(
    address: str, security: SecurityConfig, options: Sequence[tuple[str, Any]] | None = None
) -> grpc.aio.Channel:
    options = list(options if options is not None else channel_options())
    if _dials_tls(security):
        return grpc.aio.secure_channel(address, channel_credentials(security), options=options)
    return grpc.aio.insecure_channel(address, options=options)


# Each Watch holds a thread of the health port's pool; probes are few and short.
_HEALTH_PORT_WORKERS = 16


def start_health_port(health_: Health, security: SecurityConfig) -> grpc.Server | None:
    """Serve `health_`'s servicer alone on the plaintext health port, if one is set."""
    if not security.health_port:
        return None
    server = grpc.server(
        futures.ThreadPoolExecutor(_HEALTH_PORT_WORKERS, thread_name_prefix="health",
                                   initializer=name_native_thread),
        options=server_options(_HEALTH_MAX_MESSAGE_BYTES))
    health_pb2_grpc.add_HealthServicer_to_server(health_.servicer, server)
    bind(server, host_port(security.health_host, security.health_port), SecurityConfig(),
         "--health-port")
    server.start()
    return server


async def start_aio_health_port(
    health_: AioHealth, security: SecurityConfig
) -> grpc.aio.Server | None:
    """The same for an asyncio server."""
    if not security.health_port:
        return None
    server = grpc.aio.server(options=server_options(_HEALTH_MAX_MESSAGE_BYTES))
    health_pb2_grpc.add_HealthServicer_to_server(health_.servicer, server)
    bind(server, host_port(security.health_host, security.health_port), SecurityConfig(),
         "--health-port")
    await server.start()
    return server
