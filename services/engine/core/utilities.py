"""Utilities: the engine's utility calls (reset_prefix_cache, get_stats, pause,
resume, profile, the weights_* calls of live weight updates: weight_updates.py, and
sleep, wake_up, sleep_info: sleep.py).

They travel on the input queue like adds, so they run on the loop thread between
steps, in order with the requests around them; each reply goes back to the calling
Session. A failing or unknown call is answered with its error and changes nothing
else. A handler whose work runs elsewhere (staging weights on a thread, a commit
waiting for the batches in flight) returns a Future, and the reply goes when it is
done. Pausing stops scheduling, not the engine: it stays RUNNING and healthy, and new
requests queue up until `resume` (modes: abort = abort everything first; wait
= admit nothing new but let running requests finish, and answer only once they have:
`settle` resolves that reply after the step that ends the last of them; keep = freeze
all requests).
"""

from __future__ import annotations

import enum
import logging
import tempfile
from collections.abc import Callable
from concurrent.futures import Future
from pathlib import Path
from typing import TYPE_CHECKING, Any

from services.engine.config import EngineConfig
from services.engine.core.emitter import OutputEmitter
from services.engine.core.iteration_details import IterationRecorder
from services.engine.core.sentinel import Sentinel
from services.engine.core.sleep import Sleep
from services.engine.core.weight_updates import WeightUpdates
from services.engine.executor.protocol import Executor
from services.engine.messages import EngineState, UtilityCall, UtilityReply, utility_reply
from services.engine.request import FinishReason
from services.engine.scheduler.scheduler import Scheduler
from services.engine.speculative.speculator import SpeculationStats
from services.engine.waves.state import WaveState

if TYPE_CHECKING:
    from services.engine.core.lifecycle import FinishAll, Lifecycle

logger = logging.getLogger(__name__)


Reply = dict[str, Any] | Future[dict[str, Any]]


class PauseMode(enum.Enum):
    ABORT = "abort"
    WAIT = "wait"
    KEEP = "keep"


class Utilities:
    def __init__(self, config: EngineConfig, scheduler: Scheduler, executor: Executor,
                 lifecycle: Lifecycle, outputs: OutputEmitter, finish_all: FinishAll,
                 wave: Callable[[], WaveState | None], weights: WeightUpdates,
                 sleep: Sleep, details: IterationRecorder, sentinel: Sentinel) -> None:
        self._config = config
        self._scheduler = scheduler
        self._executor = executor
        self._lifecycle = lifecycle
        self._outputs = outputs
        self._finish_all = finish_all
        self._wave = wave
        self._weights = weights
        self._sleep = sleep
        self._details = details
        self._sentinel = sentinel
        self.pause_mode: PauseMode | None = None
        # Replies of "wait" pauses, sent once no request runs (settle) or on resume.
        self._drain_waiters: list[tuple[Future[dict[str, Any]], bool]] = []
        self._handlers: dict[str, Callable[[dict[str, Any]], Reply]] = {
            "reset_prefix_cache": self._reset_prefix_cache,
            "get_stats": self._get_stats,
            "pause": self._pause,
            "resume": self.resume,
            "profile": self._profile,
            "weights_info": weights.info,
            "weights_init_transfer": weights.init_transfer,
            "weights_start": weights.start,
            "weights_stage": weights.stage,
            "weights_commit": weights.commit,
            "weights_abort": weights.abort,
            "weights_hold": weights.hold,
            "weights_release": weights.release,
            "sleep": sleep.sleep,
            "wake_up": sleep.wake_up,
            "sleep_info": sleep.info,
            "fault_status": sentinel.status,
            "fault_recover": sentinel.recover,
            "fault_abort": sentinel.abort,
        }

    def run(self, call: UtilityCall) -> None:
        handler = self._handlers.get(call.method)
        if handler is None:
            known = ", ".join(sorted(self._handlers))
            reply = utility_reply(
                call, failure=f"unknown utility method {call.method!r} (known: {known})")
        else:
            try:
                result = handler(call.args)
            except Exception as exc:
                reply = self._failure(call, exc)
            else:
                if isinstance(result, Future):
                    result.add_done_callback(lambda done: self._outputs.reply(
                        self._failure(call, exc) if (exc := done.exception()) is not None
                        else utility_reply(call, result=done.result())))
                    return
                reply = utility_reply(call, result=result)
        self._outputs.reply(reply)

    def _failure(self, call: UtilityCall, exc: BaseException) -> UtilityReply:
        # A failing utility is the caller's error, never the engine's death.
        name = self._lifecycle.name
        logger.warning("%s: utility %r failed: %s", name, call.method, exc)
        return utility_reply(call, failure=f"utility {call.method!r} failed on {name}: {exc}")

    def resume(self, args: dict[str, Any] | None = None) -> dict[str, Any]:
        was = self.pause_mode
        self.pause_mode = None
        self._scheduler.admitting = True
        # A wait pause resumed before its running requests finished still answers (its
        # num_running says they had not).
        self._answer_waiters()
        return {"was_paused": was.value if was else None}

    @property
    def awaits_drain(self) -> bool:
        return bool(self._drain_waiters)

    def settle(self, batches_in_flight: bool) -> None:
        """After a step (loop thread): answer the wait pauses once no request runs and
        no batch is executing."""
        if self._drain_waiters and not self._scheduler.running and not batches_in_flight:
            self._answer_waiters()

    def _answer_waiters(self) -> None:
        waiters, self._drain_waiters = self._drain_waiters, []
        for future, clear_cache in waiters:
            future.set_result(self._paused_result(PauseMode.WAIT, 0, clear_cache))

    def _paused_result(self, mode: PauseMode, num_aborted: int,
                       clear_cache: bool) -> dict[str, Any]:
        # Requests that keep running hold their own blocks; only the cache's index of
        # them goes, so nothing computed before the pause is found after it.
        dropped = self._scheduler.kv_cache.invalidate_prefix_cache() if clear_cache else 0
        return {"mode": mode.value, "num_aborted": num_aborted,
                "num_running": len(self._scheduler.running),
                "num_waiting": len(self._scheduler.waiting),
                "num_cached_blocks_dropped": dropped}

    def _reset_prefix_cache(self, args: dict[str, Any]) -> dict[str, Any]:
        # As in vLLM: blocks held by running requests may be shared through their
        # hashes, so the cache is only reset when no request holds any.
        if self._scheduler.running:
            raise ValueError(
                f"{len(self._scheduler.running)} requests are running and hold KV blocks; "
                "pause (mode abort or wait) until none run, then reset")
        return {"num_blocks_dropped": self._scheduler.kv_cache.reset_prefix_cache()}

    def _get_stats(self, args: dict[str, Any]) -> dict[str, Any]:
        kv = self._scheduler.kv_cache
        stats = self._scheduler.stats()
        wave = self._wave()
        return {
            "engine_index": self._config.engine_index,
            "state": self._lifecycle.state.name,
            "paused": self.pause_mode.value if self.pause_mode else None,
            "weight_version": self._weights.version,
            "sleep_level": self._sleep.level,
            "num_running": stats.num_running,
            "num_waiting": stats.num_waiting,
            "kv_cache_usage": stats.kv_cache_usage,
            "num_blocks": kv.num_blocks,
            "num_free_blocks": kv.num_free_blocks,
            "num_cached_blocks": kv.pool.num_cached_blocks,
            "prefix_cache_queries": stats.prefix_cache_queries,
            "prefix_cache_hits": stats.prefix_cache_hits,
            "num_prefix_waits": stats.num_prefix_waits,
            "step_counter": stats.step_counter,
            **({"speculative_decoding": _speculation(stats.speculation)}
               if stats.speculation is not None else {}),
            **({"wave": wave.wave, "wave_running": wave.running,
                "dummy_steps": wave.num_dummy_steps} if wave is not None else {}),
            **({"iteration_details": self._details.summary()}
               if self._details.num_steps else {}),
            **({"fault": self._sentinel.status(args)} if self._sentinel.faults else {}),
        }

    def _pause(self, args: dict[str, Any]) -> Reply:
        if self._lifecycle.state is not EngineState.RUNNING:
            raise ValueError(self._lifecycle.not_running_message())
        raw = args.get("mode", PauseMode.WAIT.value)
        try:
            mode = PauseMode(raw)
        except ValueError:
            choices = ", ".join(m.value for m in PauseMode)
            raise ValueError(f"unknown pause mode {raw!r} (choose {choices})") from None
        clear_cache = args.get("clear_cache", False)
        if not isinstance(clear_cache, bool):
            raise ValueError(f"clear_cache must be true or false, got {clear_cache!r}")
        num_aborted = 0
        if mode is PauseMode.ABORT:
            aborted = self._finish_all(FinishReason.PAUSED, 0, "")
            num_aborted = len(aborted)
            self._outputs.emit(aborted)
        self.pause_mode = mode
        self._scheduler.admitting = False
        if mode is PauseMode.WAIT and self._scheduler.running:
            future: Future[dict[str, Any]] = Future()
            self._drain_waiters.append((future, clear_cache))
            return future
        if mode is not PauseMode.WAIT:
            self._answer_waiters()  # a wait pause turned into abort or keep: its wait is over
        return self._paused_result(mode, num_aborted, clear_cache)

    def _profile(self, args: dict[str, Any]) -> dict[str, Any]:
        action = args.get("action")
        if action not in ("start", "stop"):
            raise ValueError(f"profile action must be 'start' or 'stop', got {action!r}")
        # Profiling is optional (test doubles, wrappers): ask, do not assume.
        if not hasattr(self._executor, "start_profile"):
            raise ValueError(f"the model runner {type(self._executor).__name__} cannot profile")
        if action == "stop":
            return self._executor.stop_profile()
        folder = Path(self._config.profile_dir or Path(tempfile.gettempdir()) /
                      "corestream-profiles")
        return self._executor.start_profile(folder, f"engine{self._config.engine_index}")


def _speculation(spec: SpeculationStats) -> dict[str, Any]:
    return {
        "num_drafts": spec.num_drafts,
        "num_draft_tokens": spec.num_draft_tokens,
        "num_accepted_tokens": spec.num_accepted_tokens,
        "accepted_per_position": list(spec.accepted_per_position),
        "acceptance_rate": (spec.num_accepted_tokens / spec.num_draft_tokens
                            if spec.num_draft_tokens else 0.0),
        "mean_accepted_length": spec.mean_accepted_length,
    }
