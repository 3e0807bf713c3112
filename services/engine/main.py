"""`corestream engine`: one engine-core process (a data-parallel rank).

Order matters: warm the runner, serve, start the loop (readiness turns SERVING),
then register with the coordinator. SIGTERM / SIGINT only request shutdown; the
main thread then stops the reporter, tells every Session STOPPED, stops the loop
and the server with a short grace, and returns 0.
"""

from __future__ import annotations

import argparse
import logging
import sys

from corestream.coordinator.v1 import coordinator_service_pb2 as coordinator_pb

from services.common.config import add_arguments, from_args
from services.common.logs import setup_logging
from services.common.shutdown import ShutdownSignal
from services.engine.config import EngineConfig
from services.engine.engine_core import EngineCore
from services.engine.load_reporter import LoadReporter
from services.engine.server import EngineServer
from services.engine.worker.config import RunnerConfig

logger = logging.getLogger(__name__)

CONFIG_CLASSES = (EngineConfig, RunnerConfig)
STOP_GRACE_S = 2.0


def run(args: argparse.Namespace) -> int:
    config = from_args(EngineConfig, args)
    runner_config = from_args(RunnerConfig, args)
    setup_logging(f"engine{config.engine_index}", config.log_level)
    logger.info("config: %s %s", config, runner_config)
    shutdown = ShutdownSignal.install()

    # Imported here: torch loads only in the process that runs a model.
    from services.engine.worker.model_runner import ModelRunner

    runner = ModelRunner(runner_config)
    runner.warmup()
    core = EngineCore(config, runner)
    server = EngineServer(core, runner, config.host, config.port)
    server.start()
    logger.info("engine %d listening on %s", config.engine_index, server.address)
    core.start()

    reporter = None
    if config.coordinator:
        registration = coordinator_pb.RegisterEngineRequest(
            engine_index=config.engine_index,
            address=config.advertise_address or server.address,
            model=runner.model_info.name,
            max_model_len=core.max_model_len,
        )
        reporter = LoadReporter(config.coordinator, registration,
                                lambda: (core.stats, core.state))
        reporter.start()

    shutdown.wait()
    logger.info("shutdown requested")
    if reporter is not None:
        reporter.stop()
    core.shutdown()
    server.stop(STOP_GRACE_S)
    logger.info("engine %d stopped", config.engine_index)
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="corestream engine")
    for cls in CONFIG_CLASSES:
        add_arguments(parser, cls)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
