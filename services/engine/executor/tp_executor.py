"""TensorParallelExecutor: one engine's model over N ranks, as one executor.

Rank 0 runs in the engine process, inside the busy loop's step, as the in-process
`ModelRunner` does at N = 1; ranks 1..N-1 are worker processes (`tp_worker`). Keeping
rank 0 here rather than in a worker of its own saves a process and, more to the point,
a hop per step: the sampled tokens and logprobs are produced where the scheduler needs
them, and nothing comes back from the workers but their share of each collective.
The runner of rank 0 hands each model call to the workers first (`Followers`, over a
`StepChannel`: the batch once in shared memory, a small header down a pipe), so they
start their part while it starts its own.

Only rank 0 samples. The lm_head is split by vocabulary, and its slices are
all-gathered into full logits on every rank, so rank 0 samples from exactly the
logits a single device would produce; the workers drop theirs. Sampling identically
on every rank instead would need every rank to hold the requests' sampling state
(seeds, penalties' counts, grammars) in step, which is most of the scheduler's
bookkeeping, for nothing gained.

KV cache: each rank allocates what it can afford of its share of every block, and all
keep the least of those counts, so that one block table serves every rank. On CPU the
ranks share the host's memory, so each takes 1/N of `kv_cache_memory` there.

Failure: a watcher thread waits on every worker's process and pipe. A worker that
raises reports why and exits; one that dies is seen by its exit. Either way the engine
is told (`on_failure`, which makes it DEAD with the worker named); rank 0's step,
blocked in a collective the worker will never join, fails too once the workers are
killed. A worker that hangs stalls rank 0 inside a collective: the engine's watchdog
fires, and `describe_stall` names the ranks that have not finished the last call.
In an expert-parallel group a worker lives through a failed step instead (a peer of its
group died): it drops its TP connections, reports the failure and waits for the REFORM
call with which rank 0's sentinel re-forms the groups (`reform_group`).
`close` stops the workers (asked, then killed), and a worker also dies with the
engine process (PR_SET_PDEATHSIG), so none outlives its engine.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import multiprocessing
import os
import queue
import signal
import threading
import time
from collections.abc import Callable, Sequence
from multiprocessing.connection import Connection, wait
from multiprocessing.process import BaseProcess
from pathlib import Path
from typing import Any

import numpy as np
import torch

from services.common.model_info import ModelInfo
from services.common.pooling import Pooler
from services.common.ports import free_port
from services.common.thread_names import name_native_thread
from services.engine.executor.fault_injection import FaultSpec
from services.engine.executor.step_channel import CallKind, LeaderChannel, read_report
from services.engine.executor.tp_weights import LeaderWeights
from services.engine.executor.tp_worker import (
    ExpertParallelRendezvous,
    WorkerSpec,
    run_worker,
)
from services.engine.parallel.dp_group import current_dp_group
from services.engine.parallel.tp_group import current_tp_group, forget_tp_group, init_tp_group
from services.engine.scheduler.output import RunnerOutput, SchedulerOutput
from services.engine.weights.sources import SourceSpec, spec_to_json
from services.engine.weights.transfer_group import TransferGroupSpec
from services.engine.worker.batch import StepArrays
from services.engine.worker.config import RunnerConfig
from services.engine.worker.cpu_threads import resolve_num_threads
from services.engine.worker.model_runner import ModelRunner, pick_device

logger = logging.getLogger(__name__)

# How long close() lets the workers stop on their own before killing them.
STOP_GRACE_S = 2.0
# How long a failed step waits for the watcher's account of a worker's failure, whose
# message names the worker (the step's own error is a broken connection).
FAILURE_ACCOUNT_WAIT_S = 1.0
# A worker answers a REFORM call within its DP group's timeout; this much more for the
# answer to come back.
REFORM_ANSWER_MARGIN_S = 10.0


# A stage waits on the trainer's broadcast (or reads a checkpoint): the workers' shards
# take as long as rank 0's, and rank 0 has had its share of this already.
STAGE_ANSWER_TIMEOUT_S = 600.0


class WorkerFailure(RuntimeError):
    """A tensor-parallel worker died, raised or hung; the message names it."""

    fatal = True
    """The engine cannot go on without it: no re-forming helps (the sentinel reads it)."""


class TensorParallelExecutor:
    def __init__(
        self,
        config: RunnerConfig,
        size: int,
        *,
        engine_index: int = 0,
        log_level: str = "info",
        log_format: str = "text",
        worker_fault: FaultSpec | None = None,
        startup_timeout_s: float = 300.0,
        expert_parallel: ExpertParallelRendezvous | None = None,
        pooler: Pooler | None = None,
        onednn_rows: int = 0,
    ) -> None:
        """Start N-1 workers and build rank 0 here; returns once every rank has loaded its
        shard and allocated its KV cache. `worker_fault` arms a test-only fault in the
        last rank (see `tp_worker`). `expert_parallel`: where this engine's rank 0 met its
        MoE expert-parallel group (it has joined already); each worker joins the group of
        its own tensor-parallel rank."""
        if size < 2:
            raise ValueError(f"tensor_parallel_size must be >= 2 here, got {size}")
        self.size = size
        self.on_failure: Callable[[str], None] | None = None
        self._closed = False
        self._failure: str | None = None
        self._failed = threading.Event()
        self._step_failed = threading.Event()
        self._tp_broken = False
        """A step failed: the TP group's ranks may be out of step (`reform_group`)."""
        self._reformed: queue.Queue[tuple[int, str]] = queue.Queue()
        """The workers' answers to a REFORM call: (rank, "" or why it failed)."""
        device = pick_device(config.device)
        cpus, devices, config = _placement(config, size, device)
        port = free_port()
        self._channel = LeaderChannel(size - 1)
        context = multiprocessing.get_context("spawn")
        self._workers: list[BaseProcess] = []
        try:
            for rank in range(1, size):
                spec = WorkerSpec(
                    rank=rank, world_size=size, store_port=port, runner=config,
                    engine_index=engine_index, cpus=cpus[rank], device_index=devices[rank],
                    log_level=log_level, log_format=log_format,
                    startup_timeout_s=startup_timeout_s,
                    fault=worker_fault if rank == size - 1 else None,
                    expert_parallel=expert_parallel, pooler=pooler,
                    onednn_rows=onednn_rows,
                )
                process = context.Process(target=run_worker,
                                          args=(spec, self._channel.follower_end(rank)),
                                          name=f"engine{engine_index}-tp{rank}")
                process.start()
                self._workers.append(process)
            self._channel.after_start()
            if cpus[0] is not None:
                os.sched_setaffinity(0, cpus[0])
            if devices[0] is not None:
                torch.cuda.set_device(devices[0])  # rank 0's runner takes the current one
            init_tp_group(0, size, "127.0.0.1", port,
                          torch.device("cuda", devices[0]) if devices[0] is not None else None,
                          timeout_s=startup_timeout_s)
            self._runner = ModelRunner(config, followers=self, pooler=pooler)
            num_blocks = min(self._runner.num_blocks, *self._ready_reports(startup_timeout_s))
            self._channel.attached()
            self._runner.limit_num_blocks(num_blocks)
            self._channel.send(CallKind.NUM_BLOCKS, value=num_blocks)
        except BaseException:
            self.close()
            raise
        self._weights = LeaderWeights(
            lambda text: self._channel.send(CallKind.WEIGHTS, text=text), size - 1,
            lambda: self._failure)
        self._watcher = threading.Thread(target=self._watch, name="tp-workers-watcher",
                                         daemon=True)
        self._watcher.start()
        logger.info("tensor parallel over %d ranks: workers %s; %d KV blocks each", size,
                    ", ".join(f"rank {r} pid {p.pid}" for r, p in self._ranks()), num_blocks)

    # ---- Followers: what rank 0's runner hands over -----------------------------

    def forward(self, arrays: StepArrays) -> None:
        self._channel.send(CallKind.FORWARD, arrays.as_dict())

    def logits(self, rows: Sequence[int]) -> None:
        self._channel.send(CallKind.LOGITS, {"rows": np.asarray(rows, dtype=np.int64)})

    def dummy(self) -> None:
        self._channel.send(CallKind.DUMMY)

    # ---- the executor interface ------------------------------------------------

    @property
    def num_blocks(self) -> int:
        return self._runner.num_blocks

    @property
    def block_size(self) -> int:
        return self._runner.block_size

    @property
    def model_info(self) -> ModelInfo:
        return self._runner.model_info

    @property
    def device(self) -> str:
        return self._runner.device

    @property
    def dtype(self) -> str:
        return self._runner.dtype

    @property
    def tensor_parallel_size(self) -> int:
        return self.size

    @property
    def pooler(self) -> Pooler | None:
        return self._runner.pooler

    @property
    def worker_pids(self) -> list[int]:
        return [p.pid for p in self._workers if p.pid is not None]

    def warmup(self, onednn_rows: int = 0) -> None:
        # The workers built theirs on start (WorkerSpec.onednn_rows).
        self._runner.warmup(onednn_rows)

    def execute(self, out: SchedulerOutput) -> RunnerOutput:
        try:
            return self._runner.execute(out)
        except Exception as exc:
            raise self._worker_failure(exc) from exc

    def execute_dummy(self) -> None:
        try:
            self._runner.execute_dummy()
        except Exception as exc:
            raise self._worker_failure(exc) from exc

    def any_rank_has_work(self, has_work: bool) -> bool:
        return self._runner.any_rank_has_work(has_work)

    def reform_group(self, state: list[int], shrink: bool = False
                     ) -> tuple[int, list[list[int]]]:
        """Every TP rank is in the expert-parallel group of its own TP rank. After a
        failed step this engine's TP group is re-formed first, since its ranks may have
        failed at different collectives (a replacement's is whole); then rank 0's group
        re-forms here, deciding who goes on, and each worker's follows (a REFORM call
        with the members), loading the experts it owns then if they changed."""
        dp = current_dp_group()
        if dp is None:
            return self._runner.reform_group(state, shrink)
        tp = current_tp_group()
        if self._tp_broken and tp is not None:
            tp.drop()  # a worker still in a collective of the failed step fails now
            self._workers_reform(lambda: self._channel.send(CallKind.REFORM, value=1),
                                 tp.reform, tp.timeout_s)
            self._tp_broken = False
        result: list[tuple[int, list[list[int]]]] = []
        self._workers_reform(lambda: result.append(self._runner.reform_group(state, shrink)),
                             lambda: self._channel.send(CallKind.REFORM,
                                                        text=json.dumps(dp.members)),
                             dp.timeout_s)
        # A worker reports its failed step before it reads the REFORM call: no such
        # report is still to come, and an old one must not excuse a later death.
        self._step_failed.clear()
        return result[0]

    def _workers_reform(self, first: Callable[[], object], then: Callable[[], object],
                        timeout_s: float) -> None:
        """`first`, then `then`, then every worker's answer to the REFORM call one of
        them sent (within `timeout_s` and a margin); TimeoutError naming those that
        failed (the sentinel retries)."""
        self._drain_reform_answers()
        first()
        then()
        errors = self._reform_answers(timeout_s + REFORM_ANSWER_MARGIN_S)
        if errors:
            raise TimeoutError("; ".join(errors))

    def _drain_reform_answers(self) -> None:
        while not self._reformed.empty():
            self._reformed.get_nowait()

    def _reform_answers(self, timeout_s: float) -> list[str]:
        """Why the workers' re-forming failed (none: every one re-formed)."""
        deadline = time.monotonic() + timeout_s
        pending = dict(self._ranks())
        errors = []
        while pending:
            try:
                rank, error = self._reformed.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                errors += [f"tensor-parallel worker {rank} (pid {process.pid}): no answer "
                           f"within {timeout_s:g} s" for rank, process in pending.items()]
                break
            process = pending.pop(rank)
            if error:
                errors.append(f"tensor-parallel worker {rank} (pid {process.pid}): {error}")
        return errors

    def start_profile(self, folder: Path, name: str) -> dict[str, Any]:
        return self._runner.start_profile(folder, name)

    def stop_profile(self) -> dict[str, Any]:
        return self._runner.stop_profile()

    def rank_progress(self) -> list[int]:
        return self._channel.progress()

    # ---- live weight updates: every rank its own shard (tp_weights) ------------------

    def join_weight_transfer(self, spec: TransferGroupSpec) -> None:
        self._weights.join(spec, lambda: self._runner.join_weight_transfer(spec))

    def open_weight_update(self) -> None:
        self._weights.step("open", self._runner.open_weight_update)

    def stage_weights(self, spec: SourceSpec) -> dict[str, Any]:
        return self._weights.step("stage", lambda: self._runner.stage_weights(spec),
                                  {"spec": spec_to_json(spec)}, STAGE_ANSWER_TIMEOUT_S)

    def commit_weights(self) -> list[str]:
        return self._weights.step("commit", self._runner.commit_weights, all_or_none=True)

    def discard_weights(self) -> None:
        self._weights.step("discard", self._runner.discard_weights)

    def sleep(self, level: int) -> dict[str, int]:
        return self._weights.step("sleep", lambda: self._runner.sleep(level),
                                  {"level": level})

    def wake_kv_cache(self) -> dict[str, int]:
        return self._weights.step("wake_kv_cache", self._runner.wake_kv_cache)

    def describe_stall(self) -> str:
        """The ranks that have not finished the leader's last call (a hung worker)."""
        progress = self._channel.progress()
        behind = [f"worker {rank} (pid {p.pid})" for rank, p in self._ranks()
                  if progress[rank] < progress[0]]
        if not behind:
            return ""
        return (f"tensor-parallel {', '.join(behind)} did not finish call {progress[0]} "
                "(the others did)")

    def close(self) -> None:
        """Stop the workers: asked first, killed after STOP_GRACE_S (at once if one is
        hung, since a STOP waits behind its stuck call). Safe to call again."""
        if self._closed:
            return
        self._closed = True
        self._channel.close()
        deadline = time.monotonic() + STOP_GRACE_S
        for process in self._workers:
            process.join(max(0.0, deadline - time.monotonic()))
        for rank, process in self._ranks():
            if process.is_alive():
                logger.warning("tensor-parallel worker %d (pid %s) did not stop; killing it",
                               rank, process.pid)
                process.kill()
                process.join(5)
        forget_tp_group()

    # ---- failures ----------------------------------------------------------------

    def _ranks(self) -> list[tuple[int, BaseProcess]]:
        return list(enumerate(self._workers, start=1))

    def _ready_reports(self, timeout_s: float) -> list[int]:
        counts = []
        for (rank, process), conn in zip(self._ranks(), self._channel.connections, strict=True):
            if not conn.poll(timeout_s):
                raise WorkerFailure(f"tensor-parallel worker {rank} (pid {process.pid}) did "
                                    f"not start within {timeout_s:g} s")
            try:
                kind, value = read_report(conn)
            except EOFError:
                raise WorkerFailure(self._describe_exit(rank, process)) from None
            if kind != "ready":
                raise WorkerFailure(f"tensor-parallel worker {rank} (pid {process.pid}) "
                                    f"failed to start: {value}")
            counts.append(int(value))
        return counts

    def _watch(self) -> None:
        name_native_thread()
        conns = self._channel.connections
        by_object: dict[object, tuple[int, BaseProcess]] = {}
        for (rank, process), conn in zip(self._ranks(), conns, strict=True):
            by_object[conn] = by_object[process.sentinel] = (rank, process)
        reason = ""
        while not reason:
            ready = wait(list(by_object))
            if self._closed:
                return
            for obj in ready:
                rank, process = by_object[obj]
                if isinstance(obj, Connection):
                    reason = self._read_report(obj, rank, process)
                else:
                    reason = self._describe_exit(rank, process)
                if reason:
                    break
        if self._closed:
            return
        self._failure = reason
        self._failed.set()
        logger.critical("%s", reason)
        if self.on_failure is not None:
            self.on_failure(reason)
        # Unblocks rank 0 if it waits in a collective the failed worker will not join.
        self.close()

    def _read_report(self, conn: Connection, rank: int, process: BaseProcess) -> str:
        try:
            kind, value = read_report(conn)
        except (EOFError, OSError, ValueError):
            return self._describe_exit(rank, process)
        if kind == "error":
            return f"tensor-parallel worker {rank} (pid {process.pid}) raised {value}"
        if kind == "weights":
            self._weights.on_report(rank, value)
        elif kind == "step_failed":
            logger.warning("tensor-parallel worker %d (pid %s): step failed: %s", rank,
                           process.pid, value)
            self._step_failed.set()
        elif kind == "reformed":
            self._reformed.put((rank, value))
        return ""

    @staticmethod
    def _describe_exit(rank: int, process: BaseProcess) -> str:
        # Its pipe may close a moment before it can be reaped, and another thread (close)
        # may reap it first, which leaves this thread's wait empty-handed: look again.
        deadline = time.monotonic() + FAILURE_ACCOUNT_WAIT_S
        while process.exitcode is None and time.monotonic() < deadline:
            process.join(0.05)
        code = process.exitcode
        if code is None:
            how = "closed its pipe"
        elif code < 0:
            how = f"was killed by {signal.Signals(-code).name}"
        else:
            how = f"exited with code {code}"
        return f"tensor-parallel worker {rank} (pid {process.pid}) {how}"

    def _worker_failure(self, exc: Exception) -> Exception:
        """The step's error, or the worker failure behind it when there is one."""
        self._tp_broken = True
        deadline = time.monotonic() + FAILURE_ACCOUNT_WAIT_S
        while time.monotonic() < deadline:
            if self._failed.wait(0.05) and self._failure:
                return WorkerFailure(self._failure)
            if self._step_failed.is_set():
                break  # a worker lived through it: a fault of the group, not a death
        self._step_failed.clear()
        return exc


def _placement(
    config: RunnerConfig, size: int, device: torch.device
) -> tuple[list[tuple[int, ...] | None], list[int | None], RunnerConfig]:
    """Each rank's CPUs and CUDA device, and the runner config every rank uses (its
    share of the threads)."""
    if device.type == "cuda":
        first = device.index or 0
        if first + size > torch.cuda.device_count():
            raise ValueError(
                f"tensor_parallel_size {size} needs CUDA devices {first}..{first + size - 1}, "
                f"but torch sees {torch.cuda.device_count()}"
            )
        return [None] * size, list(range(first, first + size)), config
    cpus = sorted(os.sched_getaffinity(0))
    threads = resolve_num_threads(config.num_threads)
    sets: list[tuple[int, ...] | None] = [None] * size
    if len(cpus) >= size:
        # Disjoint CPU sets: a rank whose thread loses its CPU to another rank's would
        # stall every collective of the step (see cpu_threads).
        per_rank = len(cpus) // size
        sets = [tuple(cpus[r * per_rank:(r + 1) * per_rank]) for r in range(size)]
    if threads is not None:
        config = dataclasses.replace(config, num_threads=max(1, threads // size))
    return sets, [None] * size, config
