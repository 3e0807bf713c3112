"""Executor: the seam between the engine core and the model.

EngineCore drives one executor. At tensor_parallel_size 1 it is the in-process
`services.engine.worker.model_runner.ModelRunner`; at N > 1 it is a
tensor-parallel executor over N ranks (written elsewhere) that sends each step's
batch to every rank once and returns rank 0's tokens. The busy loop never
branches on the TP size: whatever the executor is, a step is schedule, execute,
update.

Threads: `execute` runs on the busy-loop thread, or on the engine's execute thread
when the batch queue is deeper than one; the rest, `close` excepted, on the
busy-loop thread. `close` may come from another thread while `execute` is stuck
(see the method).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Protocol

from services.common.model_info import ModelInfo
from services.engine.scheduler.output import RunnerOutput, SchedulerOutput


class Executor(Protocol):
    @property
    def num_blocks(self) -> int:
        """KV cache blocks the scheduler may hand out (per rank, the same on every rank)."""
        ...

    @property
    def block_size(self) -> int:
        """Tokens per KV cache block."""
        ...

    @property
    def model_info(self) -> ModelInfo: ...

    @property
    def device(self) -> str:
        """Where the model runs, as torch names it ("cpu", "cuda:0"); rank 0's under
        tensor parallelism."""
        ...

    @property
    def dtype(self) -> str:
        """The weights' and the KV cache's dtype, without the "torch." prefix."""
        ...

    @property
    def tensor_parallel_size(self) -> int:
        """Ranks the model runs over (1: this process alone)."""
        ...

    def execute(self, out: SchedulerOutput) -> RunnerOutput:
        """Run one scheduled batch; the one device-to-host sync of the step is here."""
        ...

    def execute_dummy(self) -> None:
        """A forward pass with no request, so that an idle rank of an expert-parallel
        group meets the others' collectives (only called in lockstep waves)."""
        ...

    def any_rank_has_work(self, has_work: bool) -> bool:
        """All-reduce over the expert-parallel group: does any rank have work?"""
        ...

    def start_profile(self, folder: Path, name: str) -> dict[str, Any]:
        """Start the profiler; the reply of the `profile` utility call. Optional: an
        executor without it answers that call with an error."""
        ...

    def stop_profile(self) -> dict[str, Any]: ...

    def describe_stall(self) -> str:
        """For the watchdog, when a step never ends: what the executor waits for (e.g.
        the tensor-parallel workers that have not finished the step); "" if nothing
        beyond the step itself."""
        ...

    def rank_progress(self) -> list[int]:
        """Model calls finished per tensor-parallel rank, rank 0 first (rank 0 counts the
        calls it handed to the others); [] at one rank. Read at scrape time from another
        thread: a worker whose count stops while rank 0's goes on is stalled."""
        ...

    def close(self) -> None:
        """Release what the executor holds (a TP executor stops its workers). The
        engine calls it once, when it stops or dies: after the loop has exited, or
        from the watchdog's thread while `execute` may still be stuck in a step; then
        it must not wait for that step, and should make it return or raise. A second
        call must do nothing."""
        ...
