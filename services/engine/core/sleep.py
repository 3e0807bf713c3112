"""Sleep: an engine that gives its memory back between rollouts, and takes it again.

Level 1 frees the KV cache (on CPU its pages go back to the system) and keeps the
weights; level 2 drops the weights too. Wake restores what was freed, by tag
("kv_cache", "weights"; both by default). Weights dropped by level 2 come back by an
update that replaces every tensor (from disk, a trainer, shared memory: the usual
road, while asleep), or by waking them, which reloads the checkpoint the engine
started from, with the version it started with.

While anything is freed the engine is asleep: it schedules nothing (requests that
arrive queue, within max_waiting_requests, and run after wake), so it runs no dummy
batches in a DP wave either, and its loop idles (the watchdog is off). It says so
(`level`) in its stats, GetEngineInfo and load reports: the coordinator and the
frontends see a sleeping engine, not a dead one, and its health stays SERVING, since
it takes requests.

Sleep frees KV blocks, so no request may be running: pause (mode abort or wait) first,
as RL trainers do, or wait until none is.

Utility calls (see utilities.py): sleep, wake_up, sleep_info.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

from services.engine.core.lifecycle import Lifecycle
from services.engine.core.weight_updates import WeightUpdates
from services.engine.executor.protocol import Executor
from services.engine.messages import EngineState
from services.engine.scheduler.scheduler import Scheduler
from services.engine.waves.state import WaveState

logger = logging.getLogger(__name__)

Result = dict[str, Any]

LEVELS = (1, 2)
TAGS = ("kv_cache", "weights")


class Sleep:
    def __init__(self, executor: Executor, scheduler: Scheduler, weights: WeightUpdates,
                 lifecycle: Lifecycle, start_version: str,
                 call_soon: Callable[[Callable[[], None]], None],
                 wave: Callable[[], WaveState | None]) -> None:
        """`call_soon(fn)` runs `fn` on the loop thread; `start_version` is the version of
        the checkpoint the engine loaded (what a reload of it serves again)."""
        self._executor = executor
        self._scheduler = scheduler
        self._weights = weights
        self._lifecycle = lifecycle
        self._start_version = start_version
        self._call_soon = call_soon
        self._wave = wave
        self.kv_cache_freed = False
        self.weights_dropped = False
        self._reloading: Future[Result] | None = None
        weights.on_commit.append(self._on_commit)

    @property
    def asleep(self) -> bool:
        return self.kv_cache_freed or self.weights_dropped

    @property
    def level(self) -> int:
        """0 awake; 1 the KV cache freed; 2 the weights dropped (the cache may be back)."""
        return 2 if self.weights_dropped else 1 if self.kv_cache_freed else 0

    # ---- utility handlers (loop thread) -------------------------------------------

    def info(self, args: dict[str, Any]) -> Result:
        return {"is_sleeping": self.asleep, "level": self.level,
                "kv_cache_freed": self.kv_cache_freed, "weights_dropped": self.weights_dropped,
                "reloading_weights": self._reloading is not None}

    def sleep(self, args: dict[str, Any]) -> Result:
        level = args.get("level", 1)
        if isinstance(level, bool) or level not in LEVELS:
            raise ValueError(f"level must be 1 (free the KV cache) or 2 (the weights too), "
                             f"got {level!r}")
        if self._lifecycle.state is not EngineState.RUNNING:
            raise ValueError(self._lifecycle.not_running_message())
        if running := len(self._scheduler.running):
            raise ValueError(f"{running} requests are running and hold KV blocks; pause (mode "
                             "abort or wait) until none run, then sleep")
        if (wave := self._wave()) is not None and wave.running:
            raise ValueError(f"DP wave {wave.wave} is running on this engine's group; pause "
                             "every engine (mode abort or wait), then sleep")
        if self._weights.commit_pending or self._reloading is not None:
            raise ValueError("the weights are being swapped in (an update's commit or a "
                             "reload); sleep after that")
        freed = self._executor.sleep(level)
        # The cached blocks' KV is gone with the cache.
        dropped = self._scheduler.kv_cache.reset_prefix_cache()
        self.kv_cache_freed = True
        self.weights_dropped = self.weights_dropped or level == 2
        logger.info("%s: asleep at level %d: %.1f MiB of KV cache and %.1f MiB of weights "
                    "freed, %d cached blocks dropped", self._lifecycle.name, self.level,
                    freed["kv_cache_bytes"] / 2**20, freed["weights_bytes"] / 2**20, dropped)
        return {**self.info({}), **freed, "num_cached_blocks_dropped": dropped,
                "num_waiting": len(self._scheduler.waiting)}

    def wake_up(self, args: dict[str, Any]) -> Result | Future[Result]:
        tags = args.get("tags") or list(TAGS)
        if not isinstance(tags, list) or not all(t in TAGS for t in tags):
            raise ValueError(f"tags must be a list of {', '.join(TAGS)}, got {tags!r}")
        result: Result = {}
        if "kv_cache" in tags and self.kv_cache_freed:
            result.update(self._executor.wake_kv_cache())
            self.kv_cache_freed = False
        if "weights" in tags and self.weights_dropped:
            return self._reload(result)
        return self._woken(result)

    # ---- the weights' reload --------------------------------------------------------

    def _reload(self, result: Result) -> Future[Result]:
        """Stage the start checkpoint as a live update does (off the loop), then commit it
        on the loop with the start version."""
        if self._reloading is not None:
            raise ValueError("the weights are already being reloaded")
        if self._weights.is_open:
            raise ValueError("a weight update is under way: finish it (replacing every "
                             "tensor brings the weights back) or abort it, then wake them")
        path = self._executor.model_info.path
        self._weights.start({})
        staged = self._weights.stage({"source": "disk", "path": path})
        done: Future[Result] = Future()
        self._reloading = done

        def fail(exc: BaseException) -> None:
            self._reloading = None
            done.set_exception(exc)

        def committed(commit: Future[Result]) -> None:
            if (exc := commit.exception()) is not None:
                fail(exc)
                return
            self._reloading = None
            done.set_result(self._woken({**result, "reloaded_from": path,
                                         **commit.result()}))

        def after_stage() -> None:  # loop thread
            if (exc := staged.exception()) is not None:
                fail(exc)
                return
            self._weights.commit({"weight_version": self._start_version}
                                 ).add_done_callback(committed)

        staged.add_done_callback(lambda _: self._call_soon(after_stage))
        return done

    def _on_commit(self) -> None:
        # A commit replaces every dropped weight or fails (WeightStaging checks).
        if self.weights_dropped:
            logger.info("%s: the dropped weights are back", self._lifecycle.name)
        self.weights_dropped = False

    def _woken(self, result: Result) -> Result:
        if not self.asleep:
            logger.info("%s: awake", self._lifecycle.name)
        return {**result, **self.info({})}
