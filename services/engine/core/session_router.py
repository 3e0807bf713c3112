"""SessionRouter: fans each step's outputs out to the Sessions that own them.

The busy loop emits one `StepOutputs` per step (emitter.py) and it comes here: each
open Session's queue receives a `SessionOutputs` holding only that Session's
updates.

Several frontends share an engine, each with its own Session and its own request
ids, which may collide: inside the engine a request is known by its Session's id
and the frontend's id together (`engine_request_id`), and the frontend's id is
restored on the way out (`session_request_id`). State changes (draining,
stopped, dead) are broadcast to every Session, with or without updates. A
utility call's reply takes the same queue, so it follows the outputs of the
steps before it, to the one Session that made the call.

Iteration details (iteration_details.py) reach only the Sessions that asked in their
hello, each step's after that step's outputs.

Prefix-cache events (kv_events.py) reach only the Sessions that subscribed, in
every step that made some, with or without updates for them. A Session
subscribes when its `KvSnapshot` is routed: the loop routes the snapshot after
every event it includes and before any it does not, and the emitter routes one
item at a time, in the order emitted, so the Session then receives exactly the
events after its snapshot: no gap, no duplicate.
"""

from __future__ import annotations

import queue
import threading

from services.engine.core.iteration_details import IterationDetails
from services.engine.messages import (
    KvSnapshot,
    SessionItem,
    SessionOutputs,
    StepOutputs,
    UtilityReply,
)


def engine_request_id(session_id: str, request_id: str) -> str:
    """The engine-wide id of a Session's request."""
    return f"{session_id}/{request_id}"


def session_request_id(session_id: str, engine_request_id: str) -> str:
    """The id the Session's frontend gave the request."""
    return engine_request_id.removeprefix(f"{session_id}/")


class SessionRouter:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        # SimpleQueue: put and get are C, without Queue's Python locking; each token is
        # one put by the loop and one get by the Session's thread, under the GIL both.
        self._queues: dict[str, queue.SimpleQueue[SessionItem]] = {}
        self._kv_subscribers: set[str] = set()
        self._detail_subscribers: set[str] = set()

    def open(self, session_id: str) -> queue.SimpleQueue[SessionItem]:
        q: queue.SimpleQueue[SessionItem] = queue.SimpleQueue()
        with self._lock:
            if session_id in self._queues:
                raise ValueError(f"session {session_id!r} is already open")
            self._queues[session_id] = q
        return q

    def close(self, session_id: str) -> None:
        with self._lock:
            self._queues.pop(session_id, None)
            self._kv_subscribers.discard(session_id)
            self._detail_subscribers.discard(session_id)

    def route(self, step: StepOutputs) -> None:
        with self._lock:
            targets = list(self._queues.items())
            subscribers = set(self._kv_subscribers) if step.kv_events else set()
        for session_id, q in targets:
            updates = step.by_session.get(session_id)
            events = step.kv_events if session_id in subscribers else ()
            if updates or events or step.broadcast:
                q.put(SessionOutputs(updates or [], step.stats, step.state, step.timestamp,
                                     session_id, events, step.weight_version))
        # Updates for sessions that closed meanwhile are dropped: nobody is listening.

    def subscribe_kv(self, snapshot: KvSnapshot) -> None:
        """Deliver the snapshot, then every later step's kv events, to its Session."""
        with self._lock:
            q = self._queues.get(snapshot.session_id)
            if q is None:
                return  # the Session closed meanwhile: nobody is listening
            self._kv_subscribers.add(snapshot.session_id)
        q.put(snapshot)

    def subscribe_details(self, session_id: str) -> None:
        """Send the Session every later step's iteration details."""
        with self._lock:
            if session_id in self._queues:
                self._detail_subscribers.add(session_id)

    def details_asked(self) -> bool:
        """Whether an open Session asked for iteration details (read without the lock:
        one step more or less of them does not matter)."""
        return bool(self._detail_subscribers)

    def route_details(self, details: IterationDetails) -> None:
        with self._lock:
            targets = [q for sid, q in self._queues.items() if sid in self._detail_subscribers]
        for q in targets:
            q.put(details)

    def reply(self, reply: UtilityReply) -> None:
        with self._lock:
            q = self._queues.get(reply.session_id)
        if q is not None:  # else the caller's Session closed: nobody is listening
            q.put(reply)

    def wake_all(self) -> None:
        """Unblock every Session reader (None means: the engine will send nothing more)."""
        with self._lock:
            targets = list(self._queues.values())
        for q in targets:
            q.put(None)
