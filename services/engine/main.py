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
from typing import TYPE_CHECKING

from corestream.coordinator.v1 import coordinator_service_pb2 as coordinator_pb

from services.common.config import LEFT_OUT_EXIT, add_arguments, from_args
from services.common.logs import setup_logging
from services.common.model_info import load_model_info
from services.common.observability import Observability
from services.common.observability_config import ObservabilityConfig
from services.common.pooling import Pooler, PoolingConfig, resolve_pooler
from services.common.security_config import SecurityConfig
from services.common.shutdown import ShutdownSignal
from services.common.startup_heap import freeze_startup_objects
from services.common.tiny_checkpoint import resolve_model
from services.engine.config import EngineConfig
from services.engine.core.engine_core import EngineCore
from services.engine.executor.fault_injection import ENV_VAR as FAULT_INJECT_ENV
from services.engine.executor.fault_injection import maybe_inject, worker_fault
from services.engine.kv_publisher.config import KvEventsConfig
from services.engine.kv_publisher.publisher import KvEventPublisher
from services.engine.load_reporter import LoadReporter
from services.engine.messages import EngineState
from services.engine.metrics import EngineMetrics
from services.engine.parallel.errors import LeftOut
from services.engine.server import EngineServer
from services.engine.waves.config import DataParallelConfig
from services.engine.waves.relay import WaveRelay
from services.engine.worker.config import RunnerConfig
from services.engine.worker.heap import keep_freed_memory

if TYPE_CHECKING:
    from services.engine.executor.tp_executor import TensorParallelExecutor
    from services.engine.worker.model_runner import ModelRunner

logger = logging.getLogger(__name__)

STOP_GRACE_S = 2.0
# Beyond the drain timeout, how long the loop may take to finish its last step.
JOIN_MARGIN_S = 10.0
EXIT_DEAD = 1


def run(args: argparse.Namespace) -> int:
    config = from_args(EngineConfig, args)
    runner_config = from_args(RunnerConfig, args)
    pooler = resolve_pooler(resolve_model(runner_config.model or None),
                            from_args(PoolingConfig, args))
    security = from_args(SecurityConfig, args)
    obs_config = from_args(ObservabilityConfig, args)
    dp = from_args(DataParallelConfig, args)
    kv_events = from_args(KvEventsConfig, args)
    setup_logging(f"engine{config.engine_index}", config.log_level, obs_config.log_format)
    logger.info("config: %s %s %s", config, runner_config, obs_config)
    shutdown = ShutdownSignal.install()

    expert_parallel = dp.data_parallel_size > 1 and splits_experts(runner_config)
    if expert_parallel:
        try:
            join_expert_parallel_group(config, runner_config, dp)
        except LeftOut as exc:
            logger.critical("%s; exiting with code %d", exc, LEFT_OUT_EXIT)
            return LEFT_OUT_EXIT
    runner = build_executor(config, runner_config, obs_config,
                            dp if expert_parallel else None, pooler)
    replacing = expert_parallel and replaces_a_failed_rank()
    if not replacing:
        # (A replacement's warm-up would need the others at its collectives: its first
        # steps pay for the lazy setup instead.)
        runner.warmup(onednn_rows(config))
    keep_freed_memory()
    core = EngineCore(config, maybe_inject(runner, os.environ.get(FAULT_INJECT_ENV),
                                           config.engine_index))
    if hasattr(runner, "on_failure"):
        # A tensor-parallel worker that dies or raises makes the engine DEAD at once.
        runner.on_failure = core.fail
    relay = None
    if expert_parallel:
        if config.coordinator:
            relay = WaveRelay(config.coordinator, runner.model_info.name, config.engine_index,
                              core.start_wave, security)
            relay.start()
            # Starts announced before this rank listened are replayed on subscribing.
            relay.subscribed.wait(10)
        else:
            logger.warning("expert parallel without a coordinator: a rank that gets no "
                           "request of its own never joins a wave")
        core.join_waves(dp.wave_check_interval, relay.announce if relay else None,
                        dp.prefill_schedule_interval)
        if replacing:
            try:
                core.sentinel.join_reformed_group()
            except LeftOut as exc:
                logger.critical("%s; exiting with code %d", exc, LEFT_OUT_EXIT)
                logging.shutdown()
                os._exit(LEFT_OUT_EXIT)  # (as a dead engine: gloo threads may hold on)

    def exit_when_dead(state: EngineState) -> None:
        if state is EngineState.DEAD:
            shutdown.set()

    core.add_state_listener(exit_when_dead)
    publisher = None
    if kv_events.enabled:
        publisher = KvEventPublisher(kv_events, config.engine_index,
                                     core.scheduler.kv_cache.block_size)
        core.outputs.add_kv_sink(publisher.publish)
    observability = Observability("engine", obs_config, config.host,
                                  (config, runner_config, security),
                                  {"corestream.engine.index": config.engine_index})
    metrics = EngineMetrics(observability.registry, runner.model_info.name, config.engine_index,
                            lambda: core.stats, lambda: core.state, observability.tracing,
                            runner)
    core.observer = metrics
    core.add_state_listener(lambda state: metrics.on_state(state, core.death_reason))
    observability.start_metrics()
    server = EngineServer(core, runner, config.host, config.port, security,
                          observability.interceptors())
    server.start()
    logger.info("engine %d listening on %s", config.engine_index, server.address)
    freeze_startup_objects()
    core.start()

    reporter = None
    if config.coordinator:
        registration = coordinator_pb.RegisterEngineRequest(
            engine_index=config.engine_index,
            address=config.advertise_address or server.address,
            model=runner.model_info.name,
            max_model_len=core.max_model_len,
            max_num_seqs=config.max_num_seqs,
            tensor_parallel_size=runner_config.tensor_parallel_size,
        )
        reporter = LoadReporter(config.coordinator, registration,
                                lambda: (core.stats, core.state), security,
                                wave=lambda: core.wave,
                                sleep_level=lambda: core.sleep.level)
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
    if relay is not None:
        relay.stop()
    server.stop(STOP_GRACE_S)  # lets every Session deliver its last message
    if publisher is not None:
        publisher.close()
    metrics.close()
    observability.shutdown()
    if core.state is EngineState.DEAD:
        logging.shutdown()
        sys.stderr.flush()
        os._exit(EXIT_DEAD)
    logger.info("%s stopped", core.name)
    return 0


def build_executor(config: EngineConfig, runner_config: RunnerConfig,
                   obs_config: ObservabilityConfig,
                   expert_parallel: DataParallelConfig | None = None,
                   pooler: Pooler | None = None,
                   ) -> ModelRunner | TensorParallelExecutor:
    """The model's executor: in this process at tensor_parallel_size 1, else rank 0 here
    and a worker process per other rank (each joining the expert-parallel group of its
    own rank, when `expert_parallel`). Imported here: torch loads only in the process
    that runs a model."""
    if runner_config.cpus:
        # Before any thread starts: threads inherit the CPUs of the thread that starts them.
        os.sched_setaffinity(0, runner_config.cpus)
    spec = config.speculative
    draft_model = spec.model if spec is not None and spec.method == "draft_model" else ""
    if runner_config.tensor_parallel_size == 1:
        from services.engine.worker.model_runner import ModelRunner
        return ModelRunner(runner_config, pooler=pooler, draft_model=draft_model)
    if draft_model:
        raise ValueError("speculative_config: a draft model runs with tensor_parallel_size "
                         f"1, not {runner_config.tensor_parallel_size}")
    from services.engine.executor.tp_executor import TensorParallelExecutor
    from services.engine.executor.tp_worker import ExpertParallelRendezvous

    rendezvous = None
    if expert_parallel is not None:
        host, port = expert_parallel.master_host_port
        rendezvous = ExpertParallelRendezvous(host, port, config.engine_index,
                                              expert_parallel.data_parallel_size,
                                              expert_parallel.data_parallel_timeout)
    return TensorParallelExecutor(
        runner_config, runner_config.tensor_parallel_size, engine_index=config.engine_index,
        log_level=config.log_level, log_format=obs_config.log_format,
        worker_fault=worker_fault(os.environ.get(FAULT_INJECT_ENV), config.engine_index),
        expert_parallel=rendezvous, pooler=pooler, onednn_rows=onednn_rows(config),
    )


def onednn_rows(config: EngineConfig) -> int:
    """Up to how many rows of input oneDNN's primitives are built on start: a step's
    token budget, which no forward exceeds."""
    return config.max_num_batched_tokens if config.onednn_warmup else 0


def splits_experts(runner_config: RunnerConfig) -> bool:
    """Whether the checkpoint is an MoE model, whose experts the DP ranks split."""
    from services.engine.models.loader import model_class
    from services.engine.models.moe import SparseMoeForCausalLM

    architectures = load_model_info(resolve_model(runner_config.model)).architectures
    return issubclass(model_class(list(architectures)), SparseMoeForCausalLM)


def replaces_a_failed_rank() -> bool:
    """Whether this engine joined its expert-parallel group as the replacement of a rank
    that failed (the others re-form the group to take it in)."""
    from services.engine.parallel.dp_group import current_dp_group

    group = current_dp_group()
    return group is not None and not group.formed


def join_expert_parallel_group(config: EngineConfig, runner_config: RunnerConfig,
                               dp: DataParallelConfig) -> None:
    """Join the MoE model's process group (before the model is built: each rank loads
    only its own experts)."""
    import torch

    from services.engine.parallel.dp_group import init_dp_group
    from services.engine.worker.model_runner import pick_device

    if not dp.data_parallel_master:
        raise SystemExit("--data-parallel-master HOST:PORT is needed to split an MoE "
                         f"model over {dp.data_parallel_size} ranks")
    if config.engine_index >= dp.data_parallel_size:
        raise SystemExit(f"--engine-index {config.engine_index} is not a rank of "
                         f"--data-parallel-size {dp.data_parallel_size}")
    host, port = dp.master_host_port
    device: torch.device = pick_device(runner_config.device)
    logger.info("joining the expert-parallel group as rank %d of %d (rendezvous %s)",
                config.engine_index, dp.data_parallel_size, dp.data_parallel_master)
    init_dp_group(config.engine_index, dp.data_parallel_size, host, port, device,
                  timeout_s=dp.data_parallel_timeout)


def main(argv: list[str] | None = None) -> int:
    # `python -m services.engine.main`: the flags of `corestream engine` (services.cli's
    # SERVICES lists the same classes; the engine may not import the CLI).
    parser = argparse.ArgumentParser(prog="corestream engine")
    for cls in (EngineConfig, RunnerConfig, DataParallelConfig, KvEventsConfig, PoolingConfig,
                SecurityConfig, ObservabilityConfig):
        add_arguments(parser, cls)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
