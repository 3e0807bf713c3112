"""A tensor-parallel follower: one worker process holding rank r's shard of the model.

It loads only its shard (the loader reads the current TP group), allocates its share of
every KV block, reports how many blocks it can afford, and then mirrors the leader's
model calls as they arrive on its `StepChannel` until told to stop. It never schedules
or samples: the leader (rank 0, in the engine process) does both, and its logits are
gathered from every rank's vocabulary slice.

A worker outlives nobody: it asks the kernel for SIGKILL when the engine process dies
(PR_SET_PDEATHSIG), and it ignores SIGINT and SIGTERM, which a terminal or a process
manager may send to the whole process group: the engine decides when its workers stop
(a STOP call, or end-of-file on the pipe), after draining.
"""

from __future__ import annotations

import ctypes
import dataclasses
import json
import logging
import os
import signal
import sys
import threading
import traceback
from dataclasses import dataclass
from typing import TYPE_CHECKING

from services.common.logs import setup_logging
from services.common.pooling import Pooler
from services.engine.executor.fault_injection import FaultSpec
from services.engine.executor.step_channel import Call, CallKind, FollowerChannel
from services.engine.worker.config import RunnerConfig

if TYPE_CHECKING:
    from services.engine.worker.model_runner import ModelRunner

logger = logging.getLogger(__name__)

_PR_SET_PDEATHSIG = 1
_STEP_CALLS = (CallKind.FORWARD, CallKind.LOGITS, CallKind.DUMMY)


@dataclass(frozen=True)
class ExpertParallelRendezvous:
    """Where an MoE model's expert-parallel group of rank-0s meets (the engine's
    --data-parallel-master); tensor-parallel rank r's group meets on port + r, so that
    each group joins the processes holding the same slice of every expert."""

    host: str
    port: int
    dp_rank: int
    dp_size: int
    timeout_s: float


@dataclass(frozen=True)
class WorkerSpec:
    """What a worker process is started with (pickled into it by multiprocessing)."""

    rank: int
    world_size: int
    store_port: int
    runner: RunnerConfig
    engine_index: int
    cpus: tuple[int, ...] | None
    """CPUs the worker runs on; None keeps the inherited affinity."""
    device_index: int | None
    """CUDA device of this rank; None on CPU."""
    log_level: str = "info"
    log_format: str = "text"
    startup_timeout_s: float = 300.0
    fault: FaultSpec | None = None
    """A `worker_*` fault armed in this worker (tests only)."""
    expert_parallel: ExpertParallelRendezvous | None = None
    pooler: Pooler | None = None
    """A pooling model's pooler: the rank builds the same model (no LM head)."""
    onednn_rows: int = 0
    """Build oneDNN's primitives for up to this many rows on start (`warm_onednn`)."""


def _die_with_parent() -> None:
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    except (OSError, AttributeError):
        return  # not Linux: close() still stops the workers on every orderly path
    if os.getppid() == 1:  # the engine died before we asked
        os._exit(1)


def run_worker(spec: WorkerSpec, channel: FollowerChannel) -> None:
    """The worker process's main function."""
    _die_with_parent()
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    setup_logging(f"engine{spec.engine_index}-tp{spec.rank}", spec.log_level, spec.log_format)
    try:
        channel.open()
        _serve(spec, channel)
    except EOFError:
        logger.warning("tensor-parallel rank %d: the engine is gone; exiting", spec.rank)
        os._exit(1)
    except BaseException as exc:
        text = _one_line(exc)
        logger.critical("tensor-parallel rank %d failed: %s\n%s", spec.rank, text,
                        traceback.format_exc())
        channel.report(("error", text))
        logging.shutdown()
        sys.stderr.flush()
        # Not sys.exit: gloo's threads may still hold connections, and an orderly
        # interpreter shutdown could abort in them; the leader learns from the report.
        os._exit(1)
    logging.shutdown()
    os._exit(0)


def _serve(spec: WorkerSpec, channel: FollowerChannel) -> None:
    import torch

    from services.common.startup_heap import freeze_startup_objects
    from services.engine.executor.tp_weights import FollowerWeights
    from services.engine.parallel.tp_group import init_tp_group
    from services.engine.worker.batch import StepArrays
    from services.engine.worker.heap import keep_freed_memory
    from services.engine.worker.model_runner import ModelRunner

    if spec.cpus is not None:
        os.sched_setaffinity(0, spec.cpus)
    device = None
    if spec.device_index is not None:
        torch.cuda.set_device(spec.device_index)
        device = torch.device("cuda", spec.device_index)
    if (ep := spec.expert_parallel) is not None:
        from services.engine.parallel.dp_group import init_dp_group
        init_dp_group(ep.dp_rank, ep.dp_size, ep.host, ep.port + spec.rank, device,
                      timeout_s=ep.timeout_s)
    init_tp_group(spec.rank, spec.world_size, "127.0.0.1", spec.store_port, device,
                  timeout_s=spec.startup_timeout_s)
    config = spec.runner
    if spec.device_index is not None:
        config = dataclasses.replace(config, device=f"cuda:{spec.device_index}")
    runner = ModelRunner(config, pooler=spec.pooler)
    runner.warm_onednn(spec.onednn_rows)
    keep_freed_memory()
    freeze_startup_objects()
    channel.report(("ready", runner.num_blocks))
    weights = FollowerWeights(runner, channel.report)
    forwards = 0
    hidden: torch.Tensor | None = None
    with torch.inference_mode():
        while True:
            call = channel.receive()
            if call.kind in _STEP_CALLS:
                try:
                    if call.kind is CallKind.FORWARD:
                        if spec.fault is not None:
                            _inject(spec.fault, forwards)
                        forwards += 1
                        hidden = runner.forward(StepArrays(**call.arrays))
                    elif call.kind is CallKind.LOGITS:
                        assert hidden is not None, "logits before any forward"
                        runner.logits_at(hidden, call.arrays["rows"].tolist())
                    else:
                        runner.execute_dummy()
                except Exception as exc:
                    if spec.expert_parallel is None:
                        raise
                    _step_failed(spec, channel, exc)
            elif call.kind is CallKind.REFORM:
                channel.report(("reformed", _reform(runner, call)))
            elif call.kind is CallKind.WEIGHTS:
                weights.handle(call.text)
            elif call.kind is CallKind.NUM_BLOCKS:
                runner.limit_num_blocks(call.value)
            elif call.kind is CallKind.STOP:
                logger.info("tensor-parallel rank %d stopping", spec.rank)
                return
            channel.done()


def _step_failed(spec: WorkerSpec, channel: FollowerChannel, exc: Exception) -> None:
    """A step of an expert-parallel group failed here (a peer of the group died, or this
    rank raised): the engine's sentinel pauses and re-forms the groups, so live on. The
    engine's ranks may have failed at different collectives: this rank's TP connections
    are dropped so that none waits out the timeout in one it will not join."""
    from services.engine.parallel.dp_group import current_dp_group
    from services.engine.parallel.tp_group import current_tp_group

    text = _one_line(exc)
    logger.warning("tensor-parallel rank %d: step failed (%s); waiting for the group to "
                   "re-form", spec.rank, text)
    group = current_tp_group()
    if group is not None:
        group.drop()
    # This rank's group re-forms only once rank 0's has decided who goes on, which waits
    # for rank 1's replacement, whose worker joins this group before that.
    dp = current_dp_group()
    if dp is not None:
        dp.move_epoch_on()
    channel.report(("step_failed", text))


def _reform(runner: ModelRunner, call: Call) -> str:
    """Re-form this engine's TP group (value 1), or this rank's DP group as the members
    that rank 0's group went on with (JSON in the text; the experts this rank owns then
    are loaded if they changed); "" or why it failed (the leader's sentinel retries)."""
    from services.engine.parallel.tp_group import current_tp_group

    try:
        if call.value:
            tp = current_tp_group()
            if tp is not None:
                tp.reform()
        else:
            runner.reform_group([0, 0, 0], members=json.loads(call.text))
    except Exception as exc:  # LeftOut and timeouts alike: the leader decides
        return _one_line(exc)
    return ""


def _one_line(exc: BaseException) -> str:
    """The exception as the leader reports it: its type and message."""
    return "".join(traceback.format_exception_only(type(exc), exc)).strip()


def _inject(fault: FaultSpec, forwards: int) -> None:
    """The test-only fault, once this worker has run `fault.after_steps` forwards."""
    if forwards < fault.after_steps:
        return
    if fault.kind == "worker_raise_after_steps":
        raise RuntimeError(f"injected fault in a worker after {forwards} forwards")
    logger.warning("injected hang in a worker after %d forwards", forwards)
    threading.Event().wait()
