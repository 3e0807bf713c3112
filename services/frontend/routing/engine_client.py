"""One long-lived Session stream to one engine-core, shared by all its requests.

The client sends Hello first, then add and abort messages from a send queue. A
receive loop demultiplexes each batched SessionResponse by request id into the
per-request asyncio queues handed out by `add`. The engine is routable only once
its first response (its state) has arrived and while it reports RUNNING.

When the session breaks (the engine died, even by SIGKILL), the engine reports
STOPPED, or a DEAD engine ends it with UNAVAILABLE and the reason, every request
still in flight on it receives an `EngineFailure` (UNAVAILABLE, naming the
engine) and the client reconnects with backoff; requests are never replayed,
since the engine may already have produced part of them.

Watchdog: an engine sends at least one message per SESSION_HEARTBEAT_S while it
has requests of ours, so a Session silent for `watchdog_timeout_s` with requests
in flight belongs to a frozen process (SIGSTOP, a hung host) that cannot report
anything itself: the client treats it as dead in the same way.

With a prefix index (cache-aware routing) the client subscribes to the engine's
prefix-cache events in its Hello and applies the snapshot and the events to the
index; the engine's entries are dropped whenever the Session ends, since a new
Session starts with a fresh snapshot (of a new epoch, if the engine restarted). With a
`kv_listener` (vLLM's SubscribeKvEvents, vllm_grpc/kv_events.py) the client subscribes
too, whatever the routing, and hands it every response carrying a snapshot or events.

Utility calls (admin) share the Session: `call_utility` sends one with a fresh
call id and awaits the UtilityResult carrying that id; a lost session fails the
calls still waiting.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import logging
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

import grpc
from corestream.common.v1 import common_pb2
from corestream.engine.v1 import engine_core_service_pb2 as engine_pb2
from corestream.engine.v1 import engine_core_service_pb2_grpc as engine_pb2_grpc

from services.common.backoff import Backoff
from services.common.grpc_server import make_aio_channel
from services.common.security_config import PLAINTEXT, SecurityConfig
from services.common.tasks import cancel_and_wait
from services.frontend.errors import RequestError, unavailable
from services.frontend.routing.prefix_index import PrefixIndex

log = logging.getLogger(__name__)

PROTOCOL_VERSION = 1

_ENDED_STATES = (common_pb2.ENGINE_STATE_STOPPED, common_pb2.ENGINE_STATE_DEAD)
_NOT_ACCEPTING_STATES = (common_pb2.ENGINE_STATE_DRAINING, common_pb2.ENGINE_STATE_PAUSED_FAULT,
                         *_ENDED_STATES)
_ATTEMPTS = itertools.count(1)
"""Numbers every request sent to an engine from this process (its wire id's suffix)."""


@dataclass(frozen=True)
class EngineFailure:
    """The request's engine failed it; the stream ends with this status."""

    code: grpc.StatusCode
    message: str
    engine_lost: bool = False
    """The engine died or the Session to it broke: a request that had no output yet
    may run again elsewhere."""


EngineEvent = engine_pb2.RequestOutput | EngineFailure
KvListener = Callable[["EngineClient", engine_pb2.SessionResponse], None]
"""Called on the event loop with each Session response that carries a cache snapshot
or cache events."""


class _SessionEnded(Exception):
    pass


@dataclass(frozen=True)
class UtilityOutcome:
    """An engine's answer to a utility call: its JSON result, or why it failed."""

    result_json: str = ""
    failure_message: str = ""


class EngineClient:
    def __init__(
        self,
        address: str,
        frontend_id: str,
        on_change: Callable[[], None] | None = None,
        watchdog_timeout_s: float = 0.0,
        security: SecurityConfig = PLAINTEXT,
        prefix_index: PrefixIndex | None = None,
        kv_listener: KvListener | None = None,
    ) -> None:
        """`watchdog_timeout_s` 0 disables the silence watchdog."""
        self.address = address
        self._prefix_index = prefix_index
        self._kv_listener = kv_listener
        self._security = security
        self._frontend_id = frontend_id
        self._on_change = on_change
        self._watchdog_timeout_s = watchdog_timeout_s
        self._last_heard = time.monotonic()
        self._engine_index: int | None = None
        self._streams: dict[str, tuple[str, asyncio.Queue[EngineEvent]]] = {}
        """Wire id -> (the caller's request id, its queue), of the requests in flight."""
        self._wire_ids: dict[str, str] = {}
        """The caller's request id -> the wire id the engine knows it by."""
        self._send_queue: asyncio.Queue[engine_pb2.SessionRequest | None] | None = None
        self._connected = False
        self._state: int = common_pb2.ENGINE_STATE_UNSPECIFIED
        self._task: asyncio.Task[None] | None = None
        self._channel: grpc.aio.Channel | None = None
        self._call_ids = itertools.count(1)
        self._utility_calls: dict[int, asyncio.Future[UtilityOutcome]] = {}
        self._weight_version = ""

    @property
    def connected(self) -> bool:
        return self._connected

    @property
    def running(self) -> bool | None:
        """Whether the engine's Session last said it runs (None until it says, and again
        while the Session is down)."""
        if self._state == common_pb2.ENGINE_STATE_UNSPECIFIED:
            return None
        return self._state == common_pb2.ENGINE_STATE_RUNNING

    @property
    def accepting(self) -> bool:
        """Connected and not draining: new requests may go here."""
        return self._connected and self._state not in _NOT_ACCEPTING_STATES

    @property
    def num_in_flight(self) -> int:
        return len(self._streams)

    @property
    def engine_index(self) -> int | None:
        """The engine's DP rank, once heard from."""
        return self._engine_index

    @property
    def name(self) -> str:
        """How messages name the engine: its DP rank (once heard from) and address."""
        if self._engine_index is None:
            return f"engine at {self.address}"
        return f"engine-core dp={self._engine_index} at {self.address}"

    def start(self) -> None:
        self._channel = make_aio_channel(self.address, self._security)
        self._task = asyncio.create_task(self._run(), name=f"engine-session-{self.address}")

    async def close(self) -> None:
        await cancel_and_wait(self._task)
        self._task = None
        self._set_connected(False)
        self._forget_cache()
        self._fail_all("the frontend closed its session to the engine")
        if self._channel is not None:
            await self._channel.close()
            self._channel = None

    async def get_info(self, timeout_s: float) -> engine_pb2.GetEngineInfoResponse:
        """The engine's GetEngineInfo (its KV-cache size, among others); grpc.aio errors
        pass through."""
        if self._channel is None:
            raise unavailable(f"{self.name}: no channel (the client is not started)")
        stub = engine_pb2_grpc.EngineCoreServiceStub(self._channel)
        info: engine_pb2.GetEngineInfoResponse = await stub.GetEngineInfo(
            engine_pb2.GetEngineInfoRequest(), timeout=timeout_s)
        return info

    def add(
        self,
        request: engine_pb2.AddRequest,
        queue: asyncio.Queue[EngineEvent] | None = None,
    ) -> asyncio.Queue[EngineEvent]:
        """Send the request; its outputs (and a possible failure) arrive on the queue,
        a new one or the given one (which several requests may share: outputs carry
        their request id, failures end them all)."""
        if not self.accepting or self._send_queue is None:
            raise unavailable(f"engine {self.address} is not accepting requests")
        if request.request_id in self._wire_ids:
            raise RequestError(
                grpc.StatusCode.ALREADY_EXISTS,
                f"request_id {request.request_id!r} is already running",
                field="request_id",
            )
        if queue is None:
            queue = asyncio.Queue()
        if not self._streams:
            self._last_heard = time.monotonic()  # silence counts only while busy
        # The engine knows the request by an id of this attempt alone: callers reuse a
        # request id as soon as its request ended here (an abort, a retry), while the
        # engine may still be sending the old one's last outputs, which must not reach
        # the new one's queue.
        message = engine_pb2.SessionRequest(add=request)  # (a copy of the request)
        wire_id = message.add.request_id = f"{request.request_id}@{next(_ATTEMPTS)}"
        self._streams[wire_id] = (request.request_id, queue)
        self._wire_ids[request.request_id] = wire_id
        self._send_queue.put_nowait(message)
        return queue

    def abort(self, request_id: str, notify: bool = False) -> bool:
        """Abort in the engine and stop listening; with `notify` the request's queue
        receives a FINISH_REASON_ABORT output so that its stream ends normally."""
        wire_id = self._wire_ids.pop(request_id, None)
        if wire_id is None:
            return False
        _, queue = self._streams.pop(wire_id)
        if notify:
            queue.put_nowait(
                engine_pb2.RequestOutput(
                    request_id=request_id, finish_reason=common_pb2.FINISH_REASON_ABORT
                )
            )
        if self._send_queue is not None:
            self._send_queue.put_nowait(
                engine_pb2.SessionRequest(
                    abort=engine_pb2.AbortRequests(request_ids=[wire_id])
                )
            )
        return True

    async def call_utility(self, method: str, args: dict[str, object],
                           timeout_s: float) -> UtilityOutcome:
        """Run a utility on the engine. Raises RequestError UNAVAILABLE when not
        connected or the session breaks, TimeoutError after timeout_s."""
        if not self._connected or self._send_queue is None:
            raise unavailable(f"{self.name} is not connected")
        call_id = next(self._call_ids)
        future: asyncio.Future[UtilityOutcome] = asyncio.get_running_loop().create_future()
        self._utility_calls[call_id] = future
        self._send_queue.put_nowait(engine_pb2.SessionRequest(utility=engine_pb2.UtilityCall(
            call_id=call_id, method=method, args_json=json.dumps(args))))
        try:
            return await asyncio.wait_for(future, timeout_s)
        finally:
            self._utility_calls.pop(call_id, None)

    async def _run(self) -> None:
        backoff = Backoff()
        while True:
            try:
                await self._session(backoff)
                reason = "the engine ended the session"
            except asyncio.CancelledError:
                raise
            except grpc.aio.AioRpcError as e:
                reason = f"{e.code().name}: {e.details()}"
            except _SessionEnded as e:
                reason = str(e)
            except Exception as e:  # a bug here must not stop reconnecting
                log.exception("session to engine %s failed", self.address)
                reason = repr(e)
            self._send_queue = None
            was_connected = self._connected
            self._set_connected(False)
            self._forget_cache()
            if was_connected or self._streams:
                log.warning("session to %s lost: %s", self.name, reason)
            self._fail_all(reason)
            await asyncio.sleep(backoff.next_delay())

    async def _session(self, backoff: Backoff) -> None:
        assert self._channel is not None
        await self._channel.channel_ready()
        send_queue: asyncio.Queue[engine_pb2.SessionRequest | None] = asyncio.Queue()
        send_queue.put_nowait(
            engine_pb2.SessionRequest(
                hello=engine_pb2.Hello(
                    frontend_id=self._frontend_id, protocol_version=PROTOCOL_VERSION,
                    kv_cache_events=(self._prefix_index is not None
                                     or self._kv_listener is not None),
                )
            )
        )
        stub = engine_pb2_grpc.EngineCoreServiceStub(self._channel)
        call = stub.Session(_drain(send_queue))
        reader = asyncio.create_task(self._read(call, send_queue, backoff))
        watchdog = asyncio.create_task(self._watch_silence())
        try:
            done, _ = await asyncio.wait((reader, watchdog),
                                         return_when=asyncio.FIRST_COMPLETED)
            if reader in done:
                reader.result()  # re-raises why the session ended
                return
            raise _SessionEnded(watchdog.result())
        finally:
            send_queue.put_nowait(None)
            call.cancel()
            tasks = (reader, watchdog)
            for task in tasks:
                task.cancel()
            # Wait for both to unwind without raising what they raised (the reader's end
            # was raised above already): awaiting them one by one would raise it again,
            # replacing a cancel of this task (close() racing the session's end), and
            # the client would reconnect forever instead of closing.
            await asyncio.wait(tasks)
            for task in tasks:
                if not task.cancelled():
                    task.exception()  # retrieved: no "never retrieved" warning

    async def _read(
        self,
        call: grpc.aio.StreamStreamCall,
        send_queue: asyncio.Queue[engine_pb2.SessionRequest | None],
        backoff: Backoff,
    ) -> None:
        self._state = common_pb2.ENGINE_STATE_UNSPECIFIED
        async for response in call:
            self._last_heard = time.monotonic()
            if not self._connected and (self._prefix_index is None
                                        or response.HasField("kv_cache_snapshot")):
                # The engine's first message (or, cache-aware, the snapshot of its cache
                # that follows it): it is up and not frozen, and routing knows what it
                # holds. Only now may requests go there (a frozen engine still accepts
                # TCP connections).
                self._engine_index = response.engine_index
                self._send_queue = send_queue
                self._set_connected(True)
                log.info("session to %s open", self.name)
            backoff.reset()
            self._on_response(response)

    async def _watch_silence(self) -> str:
        """Returns (the reason) once the engine is silent too long while busy."""
        if self._watchdog_timeout_s <= 0:
            await asyncio.Event().wait()  # disabled: never returns
        while True:
            await asyncio.sleep(min(0.25, self._watchdog_timeout_s / 10))
            silent_s = time.monotonic() - self._last_heard
            if self._streams and silent_s > self._watchdog_timeout_s:
                return (f"watchdog: no message for {silent_s:.1f} s with {len(self._streams)} "
                        f"requests in flight (limit {self._watchdog_timeout_s:g} s); "
                        "treating the engine as dead")

    @property
    def weight_version(self) -> str:
        """The version of the weights the engine serves, as of its latest message."""
        return self._weight_version

    def _on_response(self, response: engine_pb2.SessionResponse) -> None:
        if response.weight_version:
            self._weight_version = response.weight_version
        if response.HasField("utility_result"):
            result = response.utility_result
            future = self._utility_calls.pop(result.call_id, None)
            if future is not None and not future.done():  # else the caller gave up
                future.set_result(UtilityOutcome(result.result_json, result.failure_message))
        if self._prefix_index is not None:
            self._apply_cache_events(self._prefix_index, response)
        if self._kv_listener is not None and (response.kv_cache_events
                                              or response.HasField("kv_cache_snapshot")):
            self._kv_listener(self, response)
        for output in response.outputs:
            wire_id = output.request_id
            stream = self._streams.get(wire_id)
            if stream is None:  # aborted here while the engine was still producing
                continue
            output.request_id, queue = stream
            queue.put_nowait(output)
            if output.finish_reason != common_pb2.FINISH_REASON_UNSPECIFIED:
                del self._streams[wire_id], self._wire_ids[output.request_id]
        state = response.engine_state
        if state != common_pb2.ENGINE_STATE_UNSPECIFIED and state != self._state:
            self._state = state
            self._notify()
        if state == common_pb2.ENGINE_STATE_STOPPED:
            raise _SessionEnded(f"{self.name} is shutting down")
        # A DEAD engine ends the Session with UNAVAILABLE and the reason: read on.

    def _apply_cache_events(self, index: PrefixIndex,
                            response: engine_pb2.SessionResponse) -> None:
        if response.HasField("kv_cache_snapshot"):
            snapshot = response.kv_cache_snapshot
            index.apply_snapshot(self.address, snapshot.epoch, snapshot.seq,
                                 snapshot.block_size, snapshot.block_hashes)
        for event in response.kv_cache_events:
            kind = event.WhichOneof("kind")
            if kind == "stored":
                applied = index.stored(self.address, event.seq, event.stored.block_hash)
            elif kind == "removed":
                applied = index.removed(self.address, event.seq, event.removed.block_hash)
            else:
                applied = index.cleared(self.address, event.seq)
            if not applied and index.tracks(self.address):
                # Sessions are ordered streams, so this is a bug, not a network fault:
                # route on load to this engine until its next Session's snapshot.
                log.error("%s: prefix-cache event %d out of order; ignoring its cache "
                          "until the next session", self.name, event.seq)
                index.drop_engine(self.address)

    def _forget_cache(self) -> None:
        if self._prefix_index is not None:
            self._prefix_index.drop_engine(self.address)

    def _fail_all(self, reason: str) -> None:
        calls, self._utility_calls = self._utility_calls, {}
        for future in calls.values():
            if not future.done():
                future.set_exception(unavailable(f"{self.name} failed ({reason})"))
        streams, self._streams = self._streams, {}
        self._wire_ids = {}
        for _, queue in streams.values():
            queue.put_nowait(
                EngineFailure(
                    grpc.StatusCode.UNAVAILABLE,
                    f"{self.name} failed ({reason}); the request did not complete",
                    engine_lost=True,
                )
            )

    def _set_connected(self, connected: bool) -> None:
        if connected != self._connected:
            self._connected = connected
            self._notify()

    def _notify(self) -> None:
        if self._on_change is not None:
            self._on_change()


async def _drain(
    queue: asyncio.Queue[engine_pb2.SessionRequest | None],
) -> AsyncIterator[engine_pb2.SessionRequest]:
    while (message := await queue.get()) is not None:
        yield message
