"""`corestream coordinator`: run the DP coordinator until SIGTERM or SIGINT."""

from __future__ import annotations

import argparse
import logging
from concurrent import futures

import grpc
from corestream.coordinator.v1 import coordinator_service_pb2_grpc as pb_grpc

from services.common.config import from_args
from services.common.grpc_server import (
    INTERNAL_MAX_MESSAGE_BYTES,
    add_health_and_reflection,
    bind,
    host_port,
    server_options,
    start_health_port,
)
from services.common.logs import setup_logging
from services.common.observability import Observability
from services.common.observability_config import ObservabilityConfig
from services.common.security_config import SecurityConfig
from services.common.shutdown import ShutdownSignal
from services.common.thread_names import name_native_thread
from services.coordinator.config import CoordinatorConfig
from services.coordinator.metrics import CoordinatorCollector
from services.coordinator.registry import EngineRegistry
from services.coordinator.server import SERVICE_NAME, CoordinatorServicer

log = logging.getLogger("services.coordinator")


def run(args: argparse.Namespace) -> int:
    config = from_args(CoordinatorConfig, args)
    security = from_args(SecurityConfig, args)
    obs_config = from_args(ObservabilityConfig, args)
    setup_logging("coordinator", config.log_level, obs_config.log_format)
    observability = Observability("coordinator", obs_config, config.host, (config, security))
    shutdown = ShutdownSignal.install()
    registry = EngineRegistry()
    observability.registry.register(CoordinatorCollector(registry))
    # Each WatchLoad and ReportLoad stream holds a thread for its lifetime.
    server = grpc.server(
        futures.ThreadPoolExecutor(max_workers=64, thread_name_prefix="coordinator-rpc",
                                   initializer=name_native_thread),
        options=server_options(INTERNAL_MAX_MESSAGE_BYTES),
        interceptors=observability.interceptors(),
    )
    servicer = CoordinatorServicer(config, registry)
    pb_grpc.add_CoordinatorServiceServicer_to_server(servicer, server)
    health = add_health_and_reflection(server, [SERVICE_NAME], security.reflection)
    # A busy port is PortUnavailable, one line from `corestream` and exit code 2.
    port = bind(server, host_port(config.host, config.port), security)
    server.start()
    observability.start_metrics()
    health_server = start_health_port(health, security)
    health.set_ready(True)
    log.info("coordinator listening on %s:%d", config.host, port)
    # The main thread keeps the leases while it waits for the shutdown signal.
    while not shutdown.wait(config.lease_timeout_s / 4):
        servicer.expire_leases()
    log.info("coordinator shutting down")
    health.shutdown()
    registry.close()
    servicer.waves.close()
    server.stop(grace=2.0).wait()
    if health_server is not None:
        health_server.stop(0)
    observability.shutdown()
    return 0
