"""`corestream engine`: one engine-core process (a data-parallel rank).

Order matters: warm the runner, serve, start the loop (readiness turns SERVING),
then register with the coordinator. SIGTERM / SIGINT only request shutdown; the
main thread then drains the engine for up to --shutdown-timeout seconds (the
coordinator sees DRAINING, new requests are refused), aborts what is left, tells
every Session STOPPED, stops the reporter and the server, and returns 0.

An engine that dies (the busy loop raised, or the watchdog found it stuck) has
already told its Sessions; the process then exits with EXIT_DEAD without waiting
for the loop thread, which may be stuck in a device call that never returns.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys

from corestream.coordinator.v1 import coordinator_service_pb2 as coordinator_pb

from services.common.config import add_arguments, from_args
from services.common.logs import setup_logging
from services.common.shutdown import ShutdownSignal
from services.engine.config import EngineConfig
from services.engine.engine_core import EngineCore
from services.engine.fault_injection import ENV_VAR as FAULT_INJECT_ENV
from services.engine.fault_injection import maybe_inject
from services.engine.load_reporter import LoadReporter
from services.engine.server import EngineServer
from services.engine.session_router import EngineState
from services.engine.worker.config import RunnerConfig

logger = logging.getLogger(__name__)

CONFIG_CLASSES = (EngineConfig, RunnerConfig)
STOP_GRACE_S = 2.0
# Beyond the drain timeout, how long the loop may take to finish its last step.
JOIN_MARGIN_S = 10.0
EXIT_DEAD = 1


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
    core = EngineCore(config, maybe_inject(runner, os.environ.get(FAULT_INJECT_ENV),
                                           config.engine_index))

    def exit_when_dead(state: EngineState) -> None:
        if state is EngineState.DEAD:
            shutdown.set()

    core.add_state_listener(exit_when_dead)
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
    if core.state is not EngineState.DEAD:
        logger.info("shutdown requested: draining for up to %g s", config.shutdown_timeout)
        core.shutdown(config.shutdown_timeout, config.shutdown_timeout + JOIN_MARGIN_S)
    if core.state is EngineState.DEAD:
        logger.critical("%s is dead (%s); exiting with code %d", core.name, core.death_reason,
                        EXIT_DEAD)
    # The reporter outlives the drain so that the coordinator sees DRAINING.
    if reporter is not None:
        reporter.stop()
    server.stop(STOP_GRACE_S)  # lets every Session deliver its last message
    if core.state is EngineState.DEAD:
        logging.shutdown()
        sys.stderr.flush()
        os._exit(EXIT_DEAD)
    logger.info("%s stopped", core.name)
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="corestream engine")
    for cls in CONFIG_CLASSES:
        add_arguments(parser, cls)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
