"""Fakes and helpers shared by the engine-core tests: a deterministic fake runner, a
recording wrapper around a real one, request builders, and readers of a Session's
outputs (in process, and over gRPC)."""

from __future__ import annotations

import itertools
import json
import queue
import threading
import time
from typing import Any

import grpc
from corestream.common.v1 import common_pb2
from corestream.engine.v1 import engine_core_service_pb2 as pb
from corestream.engine.v1 import engine_core_service_pb2_grpc

from services.common.model_info import ModelInfo
from services.common.sampling import SamplingParams
from services.engine.config import EngineConfig
from services.engine.core.engine_core import EngineCore
from services.engine.executor.protocol import Executor
from services.engine.messages import SessionItem, SessionOutputs, UtilityCall, UtilityReply
from services.engine.request import Request, RequestUpdate
from services.engine.scheduler.output import RunnerOutput, SchedulerOutput

VOCAB = 100


class FakeRunner:
    """Samples (last token + 1) % VOCAB; can be told to fail or to block a step."""

    def __init__(self, num_blocks: int = 32, block_size: int = 4, max_model_len: int = 64) -> None:
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.model_info = ModelInfo("fake", "", ("Fake",), VOCAB, max_model_len, (0,), None,
                                    "float32")
        self.fail = False
        self.gate: threading.Event | None = None
        self.steps = 0
        self.delay_s = 0.0
        self.closed_on: list[str] = []
        """The thread of each close() call."""

    def execute(self, out: SchedulerOutput) -> RunnerOutput:
        self.steps += 1
        time.sleep(self.delay_s)
        if self.gate is not None:
            self.gate.wait(10)
        if self.fail:
            raise RuntimeError("device lost")
        result = RunnerOutput(
            {r.request_id: (r.token_ids[-1] + 1) % VOCAB for r in out.requests
             if r.sample and not r.num_draft_tokens})
        for r in out.requests:
            if r.num_draft_tokens:  # drafts kept while they are last + 1, as it samples
                start = len(r.token_ids) - 1 - r.num_draft_tokens
                targets = [(t + 1) % VOCAB for t in r.token_ids[start:]]
                kept = 0
                while kept < r.num_draft_tokens and r.token_ids[start + 1 + kept] == targets[kept]:
                    kept += 1
                result.verified[r.request_id] = targets[: kept + 1]
        return result

    def close(self) -> None:
        self.closed_on.append(threading.current_thread().name)

    def describe_stall(self) -> str:
        return ""


class LockstepRunner(FakeRunner):
    """A FakeRunner whose every forward (real or dummy) and every all-reduce waits for
    all ranks, so a rank that stepped alone would hang the test (the barrier times out
    after `timeout_s`, which fails that rank's step). `reform_group` re-forms the ranks:
    all meet, and the barrier is mended."""

    def __init__(self, barrier: threading.Barrier, votes: list[bool], rank: int,
                 timeout_s: float = 10.0) -> None:
        super().__init__()
        self.barrier, self.votes, self.rank = barrier, votes, rank
        self.timeout_s = timeout_s
        self.dummy_steps = 0
        self.fail_once_at: int | None = None
        """Raise in the execute call after this many real steps, once."""
        self.reformed: list[int] = []

    def execute(self, out: SchedulerOutput) -> RunnerOutput:
        if self.fail_once_at is not None and self.steps == self.fail_once_at:
            self.fail_once_at = None
            raise RuntimeError(f"rank {self.rank}: injected fault")
        self.barrier.wait(self.timeout_s)
        return super().execute(out)

    def execute_dummy(self) -> None:
        self.dummy_steps += 1
        self.barrier.wait(self.timeout_s)

    def any_rank_has_work(self, has_work: bool) -> bool:
        self.votes[self.rank] = has_work
        self.barrier.wait(self.timeout_s)
        result = any(self.votes)
        self.barrier.wait(self.timeout_s)  # nobody votes again before everyone has read
        return result

    def reform_group(self, state: list[int], shrink: bool = False
                     ) -> tuple[int, list[list[int]]]:
        group = _REFORMS.setdefault(id(self.barrier), _Reform(self.barrier.parties))
        return group.join(self.rank, state, self.barrier, self)


class _Reform:
    """Where lockstep ranks meet to re-form (one per barrier)."""

    def __init__(self, parties: int) -> None:
        self.meet = threading.Barrier(parties)
        self.states: dict[int, list[int]] = {}
        self.epoch = 0

    def join(self, rank: int, state: list[int], barrier: threading.Barrier,
             runner: LockstepRunner) -> tuple[int, list[list[int]]]:
        self.states[rank] = state
        if self.meet.wait(30) == 0:
            barrier.reset()  # nobody waits on it now: every rank is here
            self.epoch += 1
        self.meet.wait(30)
        runner.reformed.append(self.epoch)
        states = [self.states[r] for r in sorted(self.states)]
        self.meet.wait(30)  # all have read before a later re-forming writes
        return self.epoch, states


_REFORMS: dict[int, _Reform] = {}


def request(rid: str, session: str = "s", prompt: tuple[int, ...] = (1, 2, 3),
            max_tokens: int = 4) -> Request:
    return Request(rid, list(prompt), SamplingParams(temperature=0.0, max_tokens=max_tokens),
                   eos_token_ids=(0,), session_id=session)


def collect(q: queue.Queue[SessionItem], until: set[str],
            timeout: float = 10) -> tuple[dict[str, list[RequestUpdate]], list[SessionOutputs]]:
    """Drain a session queue until every id in `until` has finished."""
    by_id: dict[str, list[RequestUpdate]] = {}
    messages = []
    pending = set(until)
    while pending:
        msg = q.get(timeout=timeout)
        assert isinstance(msg, SessionOutputs)
        messages.append(msg)
        for u in msg.updates:
            by_id.setdefault(u.request_id, []).append(u)
            if u.finished:
                pending.discard(u.request_id)
    return by_id, messages


_call_ids = itertools.count(1)


def call(core: EngineCore, q: queue.Queue[SessionItem], method: str,
         args: dict[str, Any] | None = None,
         seen: list[SessionOutputs] | None = None) -> UtilityReply:
    """Make a utility call from session "s" and wait for its reply; outputs that
    arrive first are appended to `seen`."""
    call_id = next(_call_ids)
    core.call_utility(UtilityCall("s", call_id, method, args or {}))
    while True:
        item = q.get(timeout=10)
        if isinstance(item, UtilityReply):
            assert item.call_id == call_id
            return item
        if item is None:  # the engine closed the Session's queue; the reply may follow
            continue
        assert isinstance(item, SessionOutputs)
        if seen is not None:
            seen.append(item)


def ok(reply: UtilityReply) -> dict[str, Any]:
    assert not reply.failure_message, reply.failure_message
    result: dict[str, Any] = json.loads(reply.result_json)
    return result


def tokens(updates: list[RequestUpdate]) -> list[int]:
    return [t for u in updates for t in u.new_token_ids]


def tiny_runner_for_tests() -> Executor:
    """The real model runner on the built-in tiny checkpoint, warm."""
    from services.engine.worker.config import RunnerConfig
    from services.engine.worker.model_runner import ModelRunner as TorchModelRunner

    runner = TorchModelRunner(RunnerConfig(kv_cache_memory="8MiB"))
    runner.warmup()
    return runner


class RecordingRunner:
    """Wraps a runner: can report fewer blocks than it has (a small KV cache that
    forces preemption), and records the tokens each request was fed."""

    def __init__(self, runner: Executor, num_blocks: int | None = None) -> None:
        self.runner = runner
        self.num_blocks = num_blocks or runner.num_blocks
        self.block_size = runner.block_size
        self.model_info = runner.model_info
        self.num_fed: dict[str, int] = {}
        self.num_preemptions = 0
        self._end: dict[str, int] = {}

    def close(self) -> None:
        pass  # the wrapped runner outlives this core: the module's tests share it

    def describe_stall(self) -> str:
        return ""

    def execute(self, out: SchedulerOutput) -> RunnerOutput:
        for r in out.requests:
            self.num_fed[r.request_id] = self.num_fed.get(r.request_id, 0) + len(r.token_ids)
            # A request that restarts below where it was has been preempted.
            self.num_preemptions += r.start_pos < self._end.get(r.request_id, 0)
            self._end[r.request_id] = r.start_pos + len(r.token_ids)
        return self.runner.execute(out)


def run_core(runner: Executor, *waves: list[Request],
             **config: int) -> tuple[dict[str, list[RequestUpdate]], EngineCore]:
    """Run each wave of requests to completion in turn on one fresh EngineCore."""
    core = EngineCore(EngineConfig(**config), runner)  # type: ignore[arg-type]
    q = core.sessions.open("s")
    core.start()
    by_id: dict[str, list[RequestUpdate]] = {}
    try:
        for wave in waves:
            for r in wave:
                core.add_request(r)
            by_id |= collect(q, {r.request_id for r in wave}, timeout=60)[0]
    finally:
        core.shutdown()
    return by_id, core


def prompt_of(n: int, seed: int, vocab: int) -> tuple[int, ...]:
    return tuple((seed * 7919 + i * 104729) % (vocab - 3) + 3 for i in range(n))


def real_request(rid: str, prompt: tuple[int, ...], max_tokens: int = 8,
                 **sampling: object) -> Request:
    params = SamplingParams(**{"temperature": 0.0, **sampling}, max_tokens=max_tokens,  # type: ignore[arg-type]
                            ignore_eos=True)
    return Request(rid, list(prompt), params, eos_token_ids=(0,), session_id="s")


def varied_requests(vocab: int, **sampling: object) -> list[Request]:
    return [real_request(f"r{i}", prompt_of(n, i, vocab), 12, **sampling)
            for i, n in enumerate((40, 23, 5, 31))]


class SessionClient:
    """A Session whose requests are fed from a queue, so the test controls the timing."""

    def __init__(self, channel: grpc.Channel, kv_cache_events: bool = False,
                 iteration_details: bool = False) -> None:
        self._requests: queue.Queue[pb.SessionRequest | None] = queue.Queue()
        stub = engine_core_service_pb2_grpc.EngineCoreServiceStub(channel)
        self.send(pb.SessionRequest(hello=pb.Hello(frontend_id="test", protocol_version=1,
                                                   kv_cache_events=kv_cache_events,
                                                   iteration_details=iteration_details)))
        self.responses = stub.Session(iter(self._requests.get, None))
        # The engine opens every Session with its state alone.
        hello = next(self.responses)
        assert not hello.outputs and hello.engine_state == common_pb2.ENGINE_STATE_RUNNING

    def send(self, msg: pb.SessionRequest) -> None:
        self._requests.put(msg)

    def add(self, rid: str, prompt: list[int], max_tokens: int) -> None:
        sampling = common_pb2.SamplingParams(temperature=0.0, max_tokens=max_tokens)
        self.send(pb.SessionRequest(add=pb.AddRequest(
            request_id=rid, prompt_token_ids=prompt, sampling=sampling, eos_token_ids=[2])))

    def close(self) -> None:
        self._requests.put(None)

    def describe_stall(self) -> str:
        return ""

    def collect(self, ids: set[str]) -> tuple[dict[str, list[pb.RequestOutput]],
                                              list[pb.SessionResponse]]:
        outputs: dict[str, list[pb.RequestOutput]] = {}
        messages = []
        pending = set(ids)
        for msg in self.responses:
            messages.append(msg)
            for o in msg.outputs:
                outputs.setdefault(o.request_id, []).append(o)
                if o.finish_reason:
                    pending.discard(o.request_id)
            if not pending:
                break
        return outputs, messages
