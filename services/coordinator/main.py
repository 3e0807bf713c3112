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
    server_options,
)
from services.common.logs import setup_logging
from services.common.shutdown import ShutdownSignal
from services.coordinator.config import CoordinatorConfig
from services.coordinator.registry import EngineRegistry
from services.coordinator.server import SERVICE_NAME, CoordinatorServicer

CONFIG_CLASSES = (CoordinatorConfig,)

log = logging.getLogger("services.coordinator")


def run(args: argparse.Namespace) -> int:
    config = from_args(CoordinatorConfig, args)
    setup_logging("coordinator", config.log_level)
    shutdown = ShutdownSignal.install()
    registry = EngineRegistry()
    # Each WatchLoad and ReportLoad stream holds a thread for its lifetime.
    server = grpc.server(
        futures.ThreadPoolExecutor(max_workers=64, thread_name_prefix="coordinator-rpc"),
        options=server_options(INTERNAL_MAX_MESSAGE_BYTES),
    )
    pb_grpc.add_CoordinatorServiceServicer_to_server(
        CoordinatorServicer(config, registry), server
    )
    health = add_health_and_reflection(server, [SERVICE_NAME])
    port = server.add_insecure_port(f"{config.host}:{config.port}")
    if port == 0:
        log.error("cannot bind %s:%d", config.host, config.port)
        return 1
    server.start()
    health.set_ready(True)
    log.info("coordinator listening on %s:%d", config.host, port)
    shutdown.wait()
    log.info("coordinator shutting down")
    health.shutdown()
    registry.close()
    server.stop(grace=2.0).wait()
    return 0
