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
from services.common.pooling import Pooler
from services.engine.scheduler.output import RunnerOutput, SchedulerOutput
from services.engine.weights.sources import SourceSpec
from services.engine.weights.transfer_group import TransferGroupSpec


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

    pooler: Pooler | None
    """What a pooling model pools (its engine takes pooling requests only); None for a
    generative one."""

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

    def reform_group(self, state: list[int], shrink: bool = False
                     ) -> tuple[int, list[list[int]]]:
        """After a failed step, re-form the expert-parallel group under a new epoch
        (every live rank calls this; it returns once all have) and gather every rank's
        `state` ints: (epoch, states in rank order). `shrink`: the group may go on
        without the ranks that did not come back, if the others can serve the model
        (TimeoutError, saying why, if they cannot); `LeftOut`: it went on without this
        one. Optional: an executor without it has no group, and its engine retries the
        step as it is."""
        ...

    def start_profile(self, folder: Path, name: str) -> dict[str, Any]:
        """Start the profiler; the reply of the `profile` utility call. Optional: an
        executor without it answers that call with an error."""
        ...

    def stop_profile(self) -> dict[str, Any]: ...

    # Live weight updates (services/engine/weights, core/weight_updates.py): staged on
    # every rank beside the serving weights, swapped in by `commit_weights` between steps.

    def join_weight_transfer(self, spec: TransferGroupSpec) -> None:
        """Every rank joins the trainer's weight-transfer group (any thread; blocks)."""
        ...

    def open_weight_update(self) -> None:
        """Every rank starts staging an update (the loop thread)."""
        ...

    def stage_weights(self, spec: SourceSpec) -> dict[str, Any]:
        """Every rank takes its shard of the source's tensors, while steps run on (a
        thread of the engine's own; blocks). Raises WeightUpdateError naming the tensor
        when the update does not fit."""
        ...

    def commit_weights(self) -> list[str]:
        """Every rank swaps its staged tensors in (the loop thread, no batch in flight)."""
        ...

    def discard_weights(self) -> None:
        """Every rank drops what it staged."""
        ...

    # Sleep (core/sleep.py): the loop thread, between steps, with no request running.

    def sleep(self, level: int) -> dict[str, int]:
        """Every rank frees its KV cache (level 1), and its weights too (level 2); the
        bytes freed: {"kv_cache_bytes", "weights_bytes"}. A dropped weight comes back by
        a commit that replaces it."""
        ...

    def wake_kv_cache(self) -> dict[str, int]:
        """Every rank allocates its KV cache again (zeros, the same blocks)."""
        ...

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
