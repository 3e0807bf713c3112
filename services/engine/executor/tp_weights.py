"""Live weight updates over a tensor-parallel executor: every rank stages its own shard
of each tensor, and every rank swaps its shard in at the same step. Sleep and wake take
the same road: every rank frees (or allocates again) its own share.

The leader (rank 0, `TensorParallelExecutor`) sends each step of an update to the
workers as a WEIGHTS call (JSON in the call's header: op, id, arguments) and does the
same step on its own runner meanwhile; each worker answers with a ("weights", {id, ok,
result or error}) report on its pipe, which the executor's watcher hands to
`LeaderWeights.on_report`. Joining the trainer's group and staging tensors take long
(they wait on the trainer): a worker runs them on a thread of its own, so that the
leader's forward calls keep flowing meanwhile; open, commit and discard run inline,
between two model calls, where the leader sends them (a commit only when no batch is in
flight). A commit that succeeds on some ranks and fails on others leaves the model
mixing two versions: `MixedWeightsError`, which kills the engine.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import logging
import queue
import threading
import time
from collections.abc import Callable
from typing import Any, Protocol, TypeVar

from services.engine.weights.sources import spec_from_json
from services.engine.weights.staging import MixedWeightsError, WeightUpdateError
from services.engine.weights.transfer_group import TransferGroupSpec

logger = logging.getLogger(__name__)

T = TypeVar("T")

# Steps that wait on the trainer (joining, receiving) run on a worker thread.
_BACKGROUND = ("join", "stage")
# The steps without arguments: the runner's method for each.
_METHODS = {"open": "open_weight_update", "commit": "commit_weights",
            "discard": "discard_weights", "wake_kv_cache": "wake_kv_cache"}


class _Runner(Protocol):
    def join_weight_transfer(self, spec: TransferGroupSpec) -> None: ...

    def open_weight_update(self) -> None: ...

    def stage_weights(self, spec: Any) -> dict[str, Any]: ...

    def commit_weights(self) -> list[str]: ...

    def discard_weights(self) -> None: ...

    def sleep(self, level: int) -> dict[str, int]: ...

    def wake_kv_cache(self) -> dict[str, int]: ...


class FollowerWeights:
    """A worker's side: runs each step on its runner and reports the outcome."""

    def __init__(self, runner: _Runner, report: Callable[[tuple[str, Any]], None]) -> None:
        self._runner = runner
        self._report = report

    def handle(self, text: str) -> None:
        message = json.loads(text)
        op, call_id = message["op"], message["id"]
        work = self._work(op, message)
        if op in _BACKGROUND:
            threading.Thread(target=self._run, args=(call_id, op, work),
                             name=f"weights-{op}", daemon=True).start()
        else:
            self._run(call_id, op, work)

    def _work(self, op: str, message: dict[str, Any]) -> Callable[[], Any]:
        runner = self._runner
        if op == "join":
            spec = TransferGroupSpec(**message["spec"])
            return lambda: runner.join_weight_transfer(spec)
        if op == "stage":
            return lambda: runner.stage_weights(spec_from_json(message["spec"]))
        if op == "sleep":
            return lambda: runner.sleep(message["level"])
        return getattr(runner, _METHODS[op])  # type: ignore[no-any-return]

    def _run(self, call_id: int, op: str, work: Callable[[], Any]) -> None:
        try:
            result = work()
        except Exception as exc:
            logger.warning("weight update step %r failed on this rank: %s", op, exc)
            self._report(("weights", {"id": call_id, "ok": False, "error": str(exc)}))
        else:
            self._report(("weights", {"id": call_id, "ok": True, "result": result}))


class LeaderWeights:
    """Rank 0's side: one step on every rank, its outcome gathered."""

    def __init__(self, send: Callable[[str], None], num_followers: int,
                 failure: Callable[[], str | None]) -> None:
        """`send(text)` hands a WEIGHTS call to the workers; `failure()` says why the
        executor failed (a worker died), None while it has not."""
        self._send = send
        self._num_followers = num_followers
        self._failure = failure
        self._ids = itertools.count(1)
        self._replies: dict[int, queue.SimpleQueue[tuple[int, dict[str, Any]]]] = {}

    def on_report(self, rank: int, value: dict[str, Any]) -> None:
        """A worker's outcome (the executor's watcher thread)."""
        replies = self._replies.get(value.get("id", -1))
        if replies is not None:
            replies.put((rank, value))

    def join(self, spec: TransferGroupSpec, rank0: Callable[[], None]) -> None:
        self._everywhere("join", {"spec": dataclasses.asdict(spec)}, rank0,
                         spec.timeout_s + 60.0)

    def step(self, op: str, rank0: Callable[[], T], payload: dict[str, Any] | None = None,
             timeout_s: float = 60.0, all_or_none: bool = False) -> T:
        return self._everywhere(op, payload or {}, rank0, timeout_s, all_or_none)

    def _everywhere(self, op: str, payload: dict[str, Any], rank0: Callable[[], T],
                    timeout_s: float, all_or_none: bool = False) -> T:
        call_id = next(self._ids)
        replies: queue.SimpleQueue[tuple[int, dict[str, Any]]] = queue.SimpleQueue()
        self._replies[call_id] = replies
        try:
            self._send(json.dumps({"op": op, "id": call_id, **payload}))
            error: Exception | None = None
            result: T | None = None
            try:
                result = rank0()
            except Exception as exc:
                error = exc
            outcomes = self._gather(replies, op, timeout_s)
        finally:
            del self._replies[call_id]
        failed = [f"tensor-parallel rank {rank}: {value['error']}"
                  for rank, value in outcomes if not value["ok"]]
        if all_or_none and (error is None) != (not failed):
            raise MixedWeightsError(
                f"weight update step {op!r} succeeded on some tensor-parallel ranks and "
                f"failed on others ({error or '; '.join(failed)}): their weights differ")
        if error is not None:
            raise error
        if failed:
            raise WeightUpdateError("; ".join(failed))
        return result  # type: ignore[return-value]

    def _gather(self, replies: queue.SimpleQueue[tuple[int, dict[str, Any]]], op: str,
                timeout_s: float) -> list[tuple[int, dict[str, Any]]]:
        outcomes: list[tuple[int, dict[str, Any]]] = []
        deadline = time.monotonic() + timeout_s
        while len(outcomes) < self._num_followers:
            if (why := self._failure()) is not None:
                raise WeightUpdateError(f"weight update step {op!r}: {why}")
            if time.monotonic() > deadline:
                raise WeightUpdateError(
                    f"weight update step {op!r}: {self._num_followers - len(outcomes)} "
                    f"tensor-parallel worker(s) did not answer within {timeout_s:g} s")
            try:
                outcomes.append(replies.get(timeout=0.1))
            except queue.Empty:
                continue
        return sorted(outcomes, key=lambda pair: pair[0])
