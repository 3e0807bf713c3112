"""The engine core's messages: every type that crosses one of the busy loop's thread
edges, and the engine state it reports.

In: other threads (the Sessions' input threads, the grammar compiler, the wave
relay, the signal handler) put `(InputType, payload)` items on the loop's
`InputQueue`. The busy loop takes the items between steps, in order, so a request,
an abort and a utility call apply in the order they arrived.

Out: the loop emits one `StepOutputs` per step (or state change), which the session
router (core/session_router.py) splits into a `SessionOutputs` per Session; a
`UtilityReply` answers one `UtilityCall`, and a `KvSnapshot` opens a Session's
prefix-cache event stream. A Session's queue carries `SessionItem`s.

The scheduler's link to the executor has its own module (scheduler/output.py), as
has the request a Session adds (request.py).
"""

from __future__ import annotations

import enum
import json
import queue
from dataclasses import dataclass, field
from typing import Any, TypeAlias

from services.common.block_hash import BlockHash
from services.engine.core.iteration_details import IterationDetails
from services.engine.request import RequestUpdate
from services.engine.scheduler.kv_events import KvEvent
from services.engine.scheduler.scheduler import SchedulerStats


class InputType(enum.Enum):
    ADD = enum.auto()
    ABORT = enum.auto()
    WAKEUP = enum.auto()
    SHUTDOWN = enum.auto()
    UTILITY = enum.auto()
    START_WAVE = enum.auto()
    GRAMMAR_READY = enum.auto()
    KV_SUBSCRIBE = enum.auto()
    CALL = enum.auto()
    """A function to run on the loop thread (the loop's own continuations)."""


InputQueue: TypeAlias = queue.SimpleQueue[tuple[InputType, Any]]


class EngineState(enum.IntEnum):
    """Mirrors corestream.common.v1.EngineState, so the edge converts by value."""

    STARTING = 1
    RUNNING = 2
    DRAINING = 3
    STOPPED = 4
    DEAD = 5
    PAUSED_FAULT = 6


@dataclass(frozen=True, slots=True)
class UtilityCall:
    session_id: str
    call_id: int
    method: str
    args: dict[str, Any]


@dataclass(frozen=True, slots=True)
class UtilityReply:
    """The answer to one utility call, for the Session that made it."""

    call_id: int
    result_json: str = ""
    failure_message: str = ""
    session_id: str = ""


def utility_reply(call: UtilityCall, result: dict[str, Any] | None = None,
                  failure: str = "") -> UtilityReply:
    return UtilityReply(call.call_id, json.dumps(result) if result is not None else "",
                        failure, call.session_id)


@dataclass(frozen=True, slots=True)
class StepOutputs:
    """Everything one busy-loop step (or one state change) produced, by session id."""

    by_session: dict[str, list[RequestUpdate]]
    stats: SchedulerStats
    state: EngineState
    timestamp: float
    broadcast: bool = False
    """Deliver to every open Session, even those without updates (state changes)."""
    kv_events: tuple[KvEvent, ...] = ()
    """The prefix-cache changes since the previous StepOutputs, for subscribers."""
    weight_version: str = ""
    """The version of the weights that computed the step's tokens."""


@dataclass(frozen=True, slots=True)
class SessionOutputs:
    updates: list[RequestUpdate]
    stats: SchedulerStats
    state: EngineState
    timestamp: float
    session_id: str = field(default="")
    kv_events: tuple[KvEvent, ...] = ()
    weight_version: str = ""


@dataclass(frozen=True, slots=True)
class KvSnapshot:
    """The prefix cache's content for one subscribing Session."""

    session_id: str
    epoch: str
    seq: int
    """The seq of the last event the snapshot includes."""
    block_size: int
    block_hashes: list[BlockHash]


# What a Session's queue carries; None means the engine will send nothing more.
SessionItem = SessionOutputs | UtilityReply | KvSnapshot | IterationDetails | None
