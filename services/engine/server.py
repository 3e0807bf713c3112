"""EngineCoreService: the engine core's gRPC edge (protobuf stops here).

Each Session gets an input thread that turns SessionRequests into engine-core
calls, while the RPC's handler thread drains the Session's queue and yields one
SessionResponse per step that advanced any of its requests. The first response
carries only the engine state (the frontend routes to the engine once it has
heard it), and while requests are in flight a response goes out at least every
SESSION_HEARTBEAT_S, so that silence means a frozen process. When a Session ends
or breaks, its unfinished requests are aborted. A DEAD engine ends every Session
with UNAVAILABLE naming the engine and the reason. Readiness follows the engine
state: SERVING only while RUNNING (so not before warmup, nor while draining/dead).
A Hello with kv_cache_events subscribes the Session to the prefix cache: it gets
a KvCacheSnapshot, then the changes as kv_cache_events on the step responses.
"""

from __future__ import annotations

import itertools
import json
import logging
import queue
import threading
import time
from collections.abc import Iterator, Sequence
from concurrent import futures
from typing import Any

import grpc
from corestream.common.v1 import common_pb2
from corestream.engine.v1 import engine_core_service_pb2 as pb
from corestream.engine.v1 import engine_core_service_pb2_grpc

from services.common.convert import sampling_from_proto
from services.common.grpc_server import (
    INTERNAL_MAX_MESSAGE_BYTES,
    SESSION_HEARTBEAT_S,
    Health,
    add_health_and_reflection,
    bind,
    host_port,
    server_options,
    start_health_port,
)
from services.common.pooling import PoolingParams, PoolingTask, PoolingType
from services.common.security_config import PLAINTEXT, SecurityConfig
from services.common.thread_names import name_native_thread
from services.engine.core.engine_core import EngineCore
from services.engine.core.iteration_details import IterationDetails
from services.engine.core.session_router import engine_request_id, session_request_id
from services.engine.executor.protocol import Executor
from services.engine.messages import (
    EngineState,
    KvSnapshot,
    SessionItem,
    SessionOutputs,
    UtilityCall,
    UtilityReply,
)
from services.engine.request import Request, RequestUpdate
from services.engine.scheduler.kv_events import BlockRemoved, BlockStored, KvEvent
from services.engine.scheduler.output import PositionLogprobs

logger = logging.getLogger(__name__)

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["EngineCoreService"].full_name
# Sessions hold a pool thread each for their lifetime; health watchers too.
MAX_WORKERS = 256


def request_from_proto(add: pb.AddRequest, session_id: str) -> Request:
    return Request(
        request_id=engine_request_id(session_id, add.request_id),
        prompt_token_ids=list(add.prompt_token_ids),
        sampling=sampling_from_proto(add.sampling),
        eos_token_ids=tuple(add.eos_token_ids),
        arrival_time=add.arrival_time or time.time(),
        priority=add.priority,
        session_id=session_id,
        cache_salt=add.cache_salt,
        trace_headers=dict(add.trace_headers),
        pooling=pooling_from_proto(add.pooling) if add.HasField("pooling") else None,
    )


_TASKS = {pb.PoolingParams.TASK_EMBED: PoolingTask.EMBED,
          pb.PoolingParams.TASK_CLASSIFY: PoolingTask.CLASSIFY}
_POOLING_TYPES = {pb.PoolingParams.POOLING_TYPE_LAST: PoolingType.LAST,
                  pb.PoolingParams.POOLING_TYPE_MEAN: PoolingType.MEAN,
                  pb.PoolingParams.POOLING_TYPE_CLS: PoolingType.CLS,
                  pb.PoolingParams.POOLING_TYPE_ALL: PoolingType.ALL}


def pooling_from_proto(p: pb.PoolingParams) -> PoolingParams:
    return PoolingParams(
        task=_TASKS.get(p.task, PoolingTask.EMBED),
        pooling_type=_POOLING_TYPES.get(p.pooling_type),
        normalize=p.normalize if p.HasField("normalize") else None,
        dimensions=p.dimensions if p.HasField("dimensions") else None,
        activation=p.activation if p.HasField("activation") else None,
    )


# The conversions below build sub-messages from dicts inside their parent message, never
# as messages of their own: each message made on its own is an arena of protobuf's (upb),
# and protobuf calls malloc_trim(0) every 10,000 arena blocks it frees, which hands the
# model's freed activations back to the kernel between steps (heap.py). A step's prefix-
# cache events alone were a few hundred such messages: ~2,300 arenas a second in the
# Session's thread during benchmarks/pooling.py, a trim every ~2 s.


def logprobs_fields(lp: PositionLogprobs) -> dict[str, Any]:
    return {"token_id": lp.token_id, "logprob": lp.logprob, "rank": lp.rank,
            "top": [{"token_id": t, "logprob": v} for t, v in lp.top]}


def output_fields(u: RequestUpdate, weight_version: str = "") -> dict[str, Any]:
    fields: dict[str, Any] = {
        "request_id": session_request_id(u.session_id, u.request_id),
        "new_token_ids": u.new_token_ids,
        "finish_reason": int(u.finish_reason) if u.finish_reason is not None else 0,
        "num_cached_tokens": u.num_cached_tokens,
        "error_code": u.error_code,
        "error_message": u.error_message,
        "weight_version": weight_version,
    }
    if u.new_logprobs:
        fields["new_logprobs"] = [logprobs_fields(lp) for lp in u.new_logprobs]
    if u.prompt_logprobs:
        fields["prompt_logprobs"] = [logprobs_fields(lp) for lp in u.prompt_logprobs]
    if u.stop_token_id is not None:
        fields["stop_token_id"] = u.stop_token_id
    if u.pooled_shape:
        fields["pooled"] = u.pooled
        fields["pooled_shape"] = u.pooled_shape
    return fields


def output_to_proto(u: RequestUpdate, weight_version: str = "") -> pb.RequestOutput:
    return pb.RequestOutput(**output_fields(u, weight_version))


def kv_event_fields(e: KvEvent) -> dict[str, Any]:
    if isinstance(e, BlockStored):
        return {"seq": e.seq, "stored": {"block_hash": e.block_hash,
                                         "parent_hash": e.parent_hash,
                                         "token_ids": e.token_ids}}
    if isinstance(e, BlockRemoved):
        return {"seq": e.seq, "removed": {"block_hash": e.block_hash}}
    return {"seq": e.seq, "cleared": {}}


def snapshot_to_proto(snap: KvSnapshot, engine_index: int,
                      state: EngineState) -> pb.SessionResponse:
    return pb.SessionResponse(
        engine_index=engine_index,
        engine_state=common_pb2.EngineState.ValueType(int(state)),
        kv_cache_snapshot={"epoch": snap.epoch, "seq": snap.seq,
                           "block_size": snap.block_size, "block_hashes": snap.block_hashes},
    )


def details_to_proto(d: IterationDetails, engine_index: int,
                     state: EngineState) -> pb.SessionResponse:
    return pb.SessionResponse(
        engine_index=engine_index,
        engine_state=common_pb2.EngineState.ValueType(int(state)),
        iteration_details=dict(
            step=d.step, started_at=d.started_at, num_requests=d.num_requests,
            num_tokens=d.num_tokens, num_prefill_requests=d.num_prefill_requests,
            num_prefill_tokens=d.num_prefill_tokens,
            num_decode_requests=d.num_decode_requests, schedule_seconds=d.schedule_s,
            forward_seconds=d.forward_s, sample_seconds=d.sample_s,
            update_seconds=d.update_s, wave=d.wave, wave_step=d.wave_step),
    )


def response_to_proto(msg: SessionOutputs, engine_index: int) -> pb.SessionResponse:
    s = msg.stats
    return pb.SessionResponse(
        engine_index=engine_index,
        outputs=[output_fields(u, msg.weight_version) for u in msg.updates],
        scheduler_stats={
            "num_running": s.num_running, "num_waiting": s.num_waiting,
            "kv_cache_usage": s.kv_cache_usage, "step_counter": s.step_counter,
            "prefix_cache_queries": s.prefix_cache_queries,
            "prefix_cache_hits": s.prefix_cache_hits,
        },
        timestamp=msg.timestamp,
        engine_state=common_pb2.EngineState.ValueType(int(msg.state)),
        kv_cache_events=[kv_event_fields(e) for e in msg.kv_events],
        weight_version=msg.weight_version,
    )


class _SessionState:
    """What one Session's two threads share: its unfinished (engine) request ids."""

    def __init__(self, session_id: str, q: queue.SimpleQueue[SessionItem]) -> None:
        self.session_id = session_id
        self.queue = q
        self.lock = threading.Lock()
        self.unfinished: set[str] = set()
        self.input_done = False

    def done(self) -> bool:
        with self.lock:
            return self.input_done and not self.unfinished

    def busy(self) -> bool:
        with self.lock:
            return bool(self.unfinished)


class EngineCoreServicer(engine_core_service_pb2_grpc.EngineCoreServiceServicer):
    def __init__(self, core: EngineCore, runner: Executor) -> None:
        self.core = core
        self.runner = runner
        # Short and unique for the process's life: they prefix every request id inside.
        self._session_ids = itertools.count(1)

    def Session(  # noqa: N802 (gRPC method name)
        self, request_iterator: Iterator[pb.SessionRequest], context: grpc.ServicerContext
    ) -> Iterator[pb.SessionResponse]:
        session_id = f"s{next(self._session_ids)}"
        session = _SessionState(session_id, self.core.sessions.open(session_id))
        context.add_callback(lambda: session.queue.put(None))
        reader = threading.Thread(
            target=self._read_session, args=(request_iterator, session),
            name=f"session-{session.session_id}", daemon=True,
        )
        reader.start()
        try:
            yield from self._write_session(session, context)
        finally:
            self.core.sessions.close(session.session_id)
            with session.lock:
                orphans = list(session.unfinished)
            if orphans:
                logger.info("session ended; aborting %d requests", len(orphans))
                self.core.abort_requests(orphans)

    def _write_session(
        self, session: _SessionState, context: grpc.ServicerContext
    ) -> Iterator[pb.SessionResponse]:
        yield self._state_only_response()
        if self.core.state is EngineState.DEAD:
            self._abort_dead(context)
        if self.core.state is EngineState.STOPPED:
            return
        while not session.done():
            try:
                item = session.queue.get(timeout=SESSION_HEARTBEAT_S)
            except queue.Empty:
                if session.busy():
                    yield self._state_only_response()
                continue
            if item is None:
                if self.core.state is EngineState.DEAD:
                    self._abort_dead(context)
                return  # the client went away, or the engine closed
            if isinstance(item, UtilityReply):
                yield pb.SessionResponse(
                    engine_index=self.core.config.engine_index,
                    engine_state=common_pb2.EngineState.ValueType(int(self.core.state)),
                    utility_result=pb.UtilityResult(
                        call_id=item.call_id, result_json=item.result_json,
                        failure_message=item.failure_message),
                    weight_version=self.core.weights.version,
                )
                continue
            if isinstance(item, IterationDetails):
                yield details_to_proto(item, self.core.config.engine_index, self.core.state)
                continue
            if isinstance(item, KvSnapshot):
                response = snapshot_to_proto(item, self.core.config.engine_index, self.core.state)
                response.weight_version = self.core.weights.version
                yield response
                continue
            with session.lock:
                session.unfinished.difference_update(
                    u.request_id for u in item.updates if u.finished)
            yield response_to_proto(item, self.core.config.engine_index)
            if item.state is EngineState.STOPPED:
                return
            if item.state is EngineState.DEAD:
                self._abort_dead(context)

    def _state_only_response(self) -> pb.SessionResponse:
        msg = SessionOutputs([], self.core.stats, self.core.state, time.time(),
                             weight_version=self.core.weights.version)
        return response_to_proto(msg, self.core.config.engine_index)

    def _abort_dead(self, context: grpc.ServicerContext) -> None:
        context.abort(grpc.StatusCode.UNAVAILABLE,
                      f"{self.core.name} is dead ({self.core.death_reason})")

    def _read_session(
        self, request_iterator: Iterator[pb.SessionRequest], session: _SessionState
    ) -> None:
        name_native_thread()
        try:
            for msg in request_iterator:
                kind = msg.WhichOneof("kind")
                if kind == "add":
                    request = request_from_proto(msg.add, session.session_id)
                    with session.lock:
                        session.unfinished.add(request.request_id)
                    self.core.add_request(request)
                elif kind == "abort":
                    self.core.abort_requests([engine_request_id(session.session_id, rid)
                                              for rid in msg.abort.request_ids])
                elif kind == "utility":
                    self._call_utility(msg.utility, session)
                elif kind == "hello":
                    logger.info("session %s from frontend %r", session.session_id,
                                msg.hello.frontend_id)
                    if msg.hello.kv_cache_events:
                        self.core.subscribe_kv_events(session.session_id)
                    if msg.hello.iteration_details:
                        self.core.sessions.subscribe_details(session.session_id)
        except grpc.RpcError:
            pass  # the client broke the stream; the handler's callback ends the Session
        except Exception:
            logger.exception("session input failed")
            session.queue.put(None)
        with session.lock:
            session.input_done = True
            idle = not session.unfinished
        if idle:
            session.queue.put(None)

    def _call_utility(self, msg: pb.UtilityCall, session: _SessionState) -> None:
        try:
            args = json.loads(msg.args_json) if msg.args_json else {}
            if not isinstance(args, dict):
                raise ValueError("args_json must be a JSON object")
        except ValueError as exc:
            session.queue.put(UtilityReply(
                msg.call_id, failure_message=f"utility {msg.method!r}: bad args_json: {exc}"))
            return
        self.core.call_utility(UtilityCall(session.session_id, msg.call_id, msg.method, args))

    def GetEngineInfo(  # noqa: N802 (gRPC method name)
        self, request: pb.GetEngineInfoRequest, context: grpc.ServicerContext
    ) -> pb.GetEngineInfoResponse:
        info = self.runner.model_info
        return pb.GetEngineInfoResponse(
            engine_index=self.core.config.engine_index,
            model=info.name,
            max_model_len=self.core.max_model_len,
            vocab_size=info.vocab_size,
            num_kv_blocks=self.runner.num_blocks,
            block_size=self.runner.block_size,
            dtype=self.runner.dtype,
            device=self.runner.device,
            state=common_pb2.EngineState.ValueType(int(self.core.state)),
            tensor_parallel_size=self.runner.tensor_parallel_size,
            weight_version=self.core.weights.version,
            sleep_level=self.core.sleep.level,
            tasks=(self.core.pooler.tasks if self.core.pooler is not None else ("generate",)),
        )


class EngineServer:
    """The gRPC server of one engine: EngineCoreService, health and reflection."""

    def __init__(self, core: EngineCore, runner: Executor, host: str, port: int,
                 security: SecurityConfig = PLAINTEXT, interceptors: Sequence[Any] = ()) -> None:
        self.core = core
        self._security = security
        self._health_server: grpc.Server | None = None
        self.server = grpc.server(
            futures.ThreadPoolExecutor(max_workers=MAX_WORKERS, thread_name_prefix="grpc",
                                       initializer=name_native_thread),
            options=server_options(INTERNAL_MAX_MESSAGE_BYTES), interceptors=interceptors,
        )
        engine_core_service_pb2_grpc.add_EngineCoreServiceServicer_to_server(
            EngineCoreServicer(core, runner), self.server)
        self.health: Health = add_health_and_reflection(self.server, [SERVICE_NAME],
                                                        security.reflection)
        self.port = bind(self.server, host_port(host, port), security)
        self.address = host_port(host, self.port)
        core.add_state_listener(self._on_state)

    def _on_state(self, state: EngineState) -> None:
        self.health.set_ready(state is EngineState.RUNNING)
        # Liveness means forward progress: a DEAD engine (watchdog or fatal error)
        # should be restarted even if the process lingers.
        self.health.set_live(state is not EngineState.DEAD)

    def start(self) -> None:
        self.server.start()
        self._health_server = start_health_port(self.health, self._security)
        self.health.set_ready(self.core.state is EngineState.RUNNING)

    def stop(self, grace_s: float = 2.0) -> None:
        self.health.shutdown()
        self.server.stop(grace_s).wait()
        if self._health_server is not None:
            self._health_server.stop(0)
