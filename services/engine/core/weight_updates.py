"""WeightUpdates: the engine's weight version and its live weight updates.

An update goes open -> staged -> committed (vLLM's start_weight_update,
update_weights, finish_weight_update). Tensors are staged off the busy loop, on a
thread of their own, while the engine keeps serving on the old weights; the commit
swaps them in on the loop thread, between two steps with no batch in flight (it holds
scheduling back until the batch queue is empty), and there the version changes, the
prefix cache is dropped (its KV was computed by the old weights) and requests still
running stop publishing blocks. Every output carries the version of the weights that
produced it (`version`, read by the emitter). Anything that fails before the commit
drops the whole update: the engine serves on the old weights and the old version.

`hold`/`release` let a frontend switch several engines at one moment: hold all, commit
all, release all, so that no step anywhere runs while some engines have switched and
others have not.

Utility calls (see utilities.py): weights_info, weights_init_transfer, weights_start,
weights_stage, weights_commit, weights_abort, weights_hold, weights_release. The
staging and the group's join run on threads and answer through a Future.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

from services.common.weight_version import check_weight_version, next_version
from services.engine.executor.protocol import Executor
from services.engine.scheduler.scheduler import Scheduler
from services.engine.weights.sources import SOURCE_KINDS, SourceSpec, wanted_tensors
from services.engine.weights.staging import MixedWeightsError, WeightUpdateError
from services.engine.weights.transfer_group import TransferGroupSpec

logger = logging.getLogger(__name__)

Result = dict[str, Any]


class WeightUpdates:
    def __init__(self, version: str, executor: Executor, scheduler: Scheduler, name: str,
                 set_version: Callable[[str], None]) -> None:
        """`set_version` publishes a new version to whatever stamps outputs."""
        self.version = version
        self._executor = executor
        self._scheduler = scheduler
        self._name = name
        self._set_version = set_version
        self._open_since: float | None = None
        self._staging: Future[Result] | None = None
        self._staged: list[Result] = []
        self._commit: tuple[Future[Result], str] | None = None
        self._joining = False
        self._group: TransferGroupSpec | None = None
        self.held = False
        self.on_commit: list[Callable[[], None]] = []
        """Called on the loop thread after each commit that succeeded."""
        self.num_updates = 0
        self.last_update_s: float | None = None

    @property
    def blocks_scheduling(self) -> bool:
        """Whether the loop must schedule nothing now (held, or a commit waits for the
        batches in flight)."""
        return self.held or self._commit is not None

    @property
    def commit_pending(self) -> bool:
        return self._commit is not None

    @property
    def is_open(self) -> bool:
        """An update was started and has not committed or been dropped."""
        return self._open_since is not None

    # ---- utility handlers (loop thread) -------------------------------------------

    def info(self, args: dict[str, Any]) -> Result:
        return {"weight_version": self.version, "update": self._phase(),
                "tensor_parallel_size": self._executor.tensor_parallel_size,
                "num_updates": self.num_updates, "last_update_s": self.last_update_s,
                "held": self.held,
                "transfer_group": (None if self._group is None else {
                    "master_address": self._group.master_address,
                    "master_port": self._group.master_port,
                    "rank_offset": self._group.rank_offset,
                    "world_size": self._group.world_size})}

    def init_transfer(self, args: dict[str, Any]) -> Future[Result]:
        if self._joining:
            raise WeightUpdateError("this engine is already joining a weight-transfer group")
        if self._staging is not None:
            raise WeightUpdateError("tensors are being received; init the group after that")
        spec = TransferGroupSpec(
            str(args.get("master_address", "")), _int(args, "master_port"),
            _int(args, "rank_offset"), _int(args, "world_size"),
            float(args.get("timeout_s", 300.0)))
        self._joining = True

        def join() -> Result:
            try:
                self._executor.join_weight_transfer(spec)
            finally:
                self._joining = False
            self._group = spec
            return {"rank_offset": spec.rank_offset, "world_size": spec.world_size,
                    "ranks": self._executor.tensor_parallel_size}

        return _on_thread(join, "weights-join")

    def start(self, args: dict[str, Any]) -> Result:
        if self._open_since is not None:
            raise WeightUpdateError(
                f"a weight update is under way (open for "
                f"{time.monotonic() - self._open_since:.1f} s); finish or abort it first")
        self._executor.open_weight_update()
        self._open_since = time.monotonic()
        self._staged = []
        return {"weight_version": self.version}

    def stage(self, args: dict[str, Any]) -> Future[Result]:
        if self._open_since is None:
            raise WeightUpdateError("no weight update is open: start one first "
                                    "(start_weight_update)")
        if self._staging is not None:
            raise WeightUpdateError("tensors are already being received for this update; "
                                    "wait for that call to end")
        if self._commit is not None:
            raise WeightUpdateError("the update is committing")
        spec = _source_spec(args)
        started = time.monotonic()

        def stage() -> Result:
            try:
                result = self._executor.stage_weights(spec)
            except Exception:
                # The update fails as a whole: nothing staged so far is kept.
                self._staging = None
                self._drop(f"staging from {spec.kind} failed")
                raise
            self._staging = None
            seconds = time.monotonic() - started
            result = {**result, "seconds": round(seconds, 4),
                      "gb_per_s": round(result["num_bytes"] / max(seconds, 1e-9) / 1e9, 3)}
            self._staged.append(result)
            return result

        # Set before the thread starts: it clears it when done.
        self._staging = Future()
        return _on_thread(stage, "weights-stage", self._staging)

    def commit(self, args: dict[str, Any]) -> Future[Result]:
        if self._open_since is None:
            raise WeightUpdateError("no weight update is open: start one first "
                                    "(start_weight_update)")
        if self._staging is not None:
            raise WeightUpdateError("tensors are still being received; wait for that call "
                                    "to end, then finish")
        if self._commit is not None:
            raise WeightUpdateError("the update is already committing")
        version = args.get("weight_version")
        version = next_version(self.version) if version in (None, "") else str(version)
        check_weight_version(version, "weight_version")
        future: Future[Result] = Future()
        self._commit = (future, version)
        return future

    def abort(self, args: dict[str, Any]) -> Result:
        if self._staging is not None:
            raise WeightUpdateError("tensors are being received; abort after that call ends "
                                    "(a failed receive aborts the update by itself)")
        was_open = self._open_since is not None
        if self._commit is not None:
            future, _ = self._commit
            self._commit = None
            future.set_exception(WeightUpdateError("the update was aborted"))
        self._drop("aborted")
        return {"aborted": was_open, "weight_version": self.version}

    def hold(self, args: dict[str, Any]) -> Result:
        self.held = True
        return {"held": True}

    def release(self, args: dict[str, Any]) -> Result:
        was = self.held
        self.held = False
        return {"held": False, "was_held": was}

    # ---- the commit (loop thread, no batch in flight) -----------------------------

    def run_commit(self) -> None:
        assert self._commit is not None
        future, version = self._commit
        self._commit = None
        started = time.monotonic()
        try:
            replaced = self._executor.commit_weights()
        except Exception as exc:
            logger.exception("%s: committing the weight update failed", self._name)
            self._drop("commit failed")
            future.set_exception(exc)
            if isinstance(exc, MixedWeightsError):
                raise  # tensor-parallel ranks now hold different versions: never serve on
            return
        seconds = time.monotonic() - started
        # Cached KV was computed by the old weights; requests that run on keep their own
        # blocks but publish none of them.
        num_dropped = self._scheduler.kv_cache.invalidate_prefix_cache()
        old, self.version = self.version, version
        self._set_version(version)
        self.num_updates += 1
        self.last_update_s = time.time()
        num_tensors = sum(s["num_tensors"] for s in self._staged)
        num_bytes = sum(s["num_bytes"] for s in self._staged)
        self._open_since = None
        self._staged = []
        for listener in self.on_commit:
            listener()
        logger.info("%s: weights updated to version %r (was %r): %d tensors, %d parameters "
                    "swapped in %.3f s; %d cached KV blocks dropped", self._name, version, old,
                    num_tensors, len(replaced), seconds, num_dropped)
        future.set_result({"weight_version": version, "previous_weight_version": old,
                           "num_tensors": num_tensors, "num_bytes": num_bytes,
                           "num_parameters": len(replaced), "commit_seconds": round(seconds, 4),
                           "num_cached_blocks_dropped": num_dropped,
                           "num_running": len(self._scheduler.running)})

    def _drop(self, why: str) -> None:
        if self._open_since is not None:
            logger.warning("%s: weight update dropped (%s); serving on version %r",
                           self._name, why, self.version)
        self._executor.discard_weights()
        self._open_since = None
        self._staged = []

    def _phase(self) -> str:
        if self._commit is not None:
            return "committing"
        if self._staging is not None:
            return "receiving"
        return "open" if self._open_since is not None else "none"


def _int(args: dict[str, Any], key: str) -> int:
    value = args.get(key)
    if isinstance(value, bool) or not isinstance(value, int):
        raise WeightUpdateError(f"{key} must be an integer, got {value!r}")
    return value


def _source_spec(args: dict[str, Any]) -> SourceSpec:
    kind = args.get("source")
    if kind not in SOURCE_KINDS:
        raise WeightUpdateError(f"source must be one of {', '.join(SOURCE_KINDS)}, got {kind!r}")
    if kind == "disk":
        path = args.get("path")
        if not isinstance(path, str) or not path:
            raise WeightUpdateError("path (a checkpoint folder) is required")
        return SourceSpec("disk", path)
    wanted = wanted_tensors(args.get("names") or [], args.get("dtype_names") or [],
                            args.get("shapes") or [])
    if not wanted:
        raise WeightUpdateError("names is empty: an update needs at least one tensor")
    if kind == "broadcast":
        return SourceSpec("broadcast", wanted=tuple(wanted))
    path = args.get("path")
    if not isinstance(path, str) or not path:
        raise WeightUpdateError("path (the shared-memory file) is required")
    offsets = args.get("offsets") or []
    if not all(isinstance(o, int) and not isinstance(o, bool) for o in offsets):
        raise WeightUpdateError("offsets must be integers")
    return SourceSpec("shared_memory", path, tuple(wanted), tuple(offsets))


def _on_thread(work: Callable[[], Result], name: str,
               future: Future[Result] | None = None) -> Future[Result]:
    """`work()`'s result, from a thread of its own, in `future` (a new one if None)."""
    future = future if future is not None else Future()

    def run() -> None:
        try:
            result = work()
        except BaseException as exc:
            future.set_exception(exc)
        else:
            future.set_result(result)

    threading.Thread(target=run, name=name, daemon=True).start()
    return future
