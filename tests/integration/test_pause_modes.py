"""Pause modes under load through a real cluster (`corestream serve --engines 2`, the
built-in tiny model): 64 greedy streams, half pinned to each engine, are paused once
every one of them has its first token.

- abort: every stream ends at once with FINISH_REASON_PAUSED and the tokens it had;
  requests sent while paused queue and run after the resume.
- wait: every stream runs to its end (length), and the pause answers only then; a
  request sent while paused starts only after the resume, and IsPaused says so
  meanwhile.
- keep: no engine steps while paused and every request stays running (its KV held);
  after the resume every stream's tokens are those of the same request never paused.

The tests share one cluster; each resumes the engines, whatever happens.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable, Iterator

import grpc
import pytest
from corestream.common.v1 import common_pb2
from corestream.generate.v1 import admin_service_pb2 as admin_pb
from corestream.generate.v1 import admin_service_pb2_grpc as admin_grpc
from corestream.generate.v1 import generate_service_pb2 as pb
from corestream.generate.v1 import generate_service_pb2_grpc as pb_grpc

from tests.integration.cluster import Cluster

pytestmark = pytest.mark.timeout(120)

NUM_STREAMS = 64
# Between the streams' start (both engines resumed at once) and the pause under test an
# engine runs 5 to 60 steps, depending on the load: far fewer than this.
MAX_TOKENS = 300
LENGTH = common_pb2.FINISH_REASON_LENGTH
PAUSED = common_pb2.FINISH_REASON_PAUSED


@pytest.fixture(scope="module")
def cluster() -> Iterator[Cluster]:
    c = Cluster(["--engines", "2", "--kv-cache-memory", "16MiB"])
    yield c
    c.stop()


@pytest.fixture(scope="module")
def channel(cluster: Cluster) -> Iterator[grpc.Channel]:
    with grpc.insecure_channel(cluster.address) as ch:
        yield ch


@pytest.fixture(scope="module")
def stub(channel: grpc.Channel) -> pb_grpc.GenerateServiceStub:
    return pb_grpc.GenerateServiceStub(channel)


@pytest.fixture
def admin(channel: grpc.Channel) -> Iterator[admin_grpc.AdminServiceStub]:
    stub = admin_grpc.AdminServiceStub(channel)
    yield stub
    resume(stub)


def request(i: int, max_tokens: int) -> pb.GenerateStreamRequest:
    return pb.GenerateStreamRequest(
        token_ids=pb.TokenIds(ids=[3 + i, 7, 9, 11]), data_parallel_rank=i % 2,
        sampling=common_pb2.SamplingParams(temperature=0.0, max_tokens=max_tokens,
                                           ignore_eos=True))


class Streams:
    """`count` greedy streams, each read on its own thread, stream i on engine i % 2."""

    def __init__(self, stub: pb_grpc.GenerateServiceStub, max_tokens: int,
                 count: int = NUM_STREAMS, first: int = 0) -> None:
        self.tokens: list[list[int]] = [[] for _ in range(count)]
        self.finish_reasons = [0] * count
        self.finished_at = [0.0] * count
        self.completion_tokens = [0] * count
        self.arrivals: list[float] = []  # the time of every chunk with tokens
        self.errors: list[grpc.RpcError] = []
        self._changed = threading.Condition()
        self._threads = [threading.Thread(target=self._read, args=(stub, i, first + i, max_tokens))
                         for i in range(count)]
        for thread in self._threads:
            thread.start()

    def _read(self, stub: pb_grpc.GenerateServiceStub, i: int, prompt: int,
              max_tokens: int) -> None:
        try:
            for chunk in stub.GenerateStream(request(prompt, max_tokens), timeout=100):
                with self._changed:
                    if chunk.token_ids:
                        self.tokens[i] += chunk.token_ids
                        self.arrivals.append(time.monotonic())
                    if chunk.finish_reason:
                        self.finish_reasons[i] = chunk.finish_reason
                        self.finished_at[i] = time.monotonic()
                        self.completion_tokens[i] = chunk.usage.completion_tokens
                    self._changed.notify_all()
        except grpc.RpcError as e:
            with self._changed:
                self.errors.append(e)
                self._changed.notify_all()

    def wait_until(self, done: Callable[[], bool], timeout: float = 60) -> None:
        with self._changed:
            self._changed.wait_for(lambda: done() or self.errors, timeout)
            assert not self.errors, self.errors
            assert done(), f"tokens so far: {[len(t) for t in self.tokens]}"

    def arrived_between(self, start: float, end: float) -> list[float]:
        """When chunks with tokens arrived in (start, end), as seconds after start."""
        with self._changed:
            return [t - start for t in self.arrivals if start < t < end]

    def all_started(self) -> bool:
        return all(self.tokens)

    def all_finished(self) -> bool:
        return all(self.finish_reasons)

    def join(self) -> None:
        for thread in self._threads:
            thread.join(100)
        assert not self.errors, self.errors


def pause(admin: admin_grpc.AdminServiceStub, mode: int,
          engine: int | None = None) -> list[dict[str, object]]:
    # Mode wait answers once the running streams finished.
    reply = admin.PauseScheduling(
        admin_pb.PauseSchedulingRequest(mode=mode, engine_index=engine), timeout=120)
    assert all(r.ok for r in reply.results), reply
    return [json.loads(r.result_json) for r in reply.results]


def resume(admin: admin_grpc.AdminServiceStub, engine: int | None = None) -> None:
    reply = admin.ResumeScheduling(admin_pb.ResumeSchedulingRequest(engine_index=engine),
                                   timeout=20)
    assert all(r.ok for r in reply.results), reply


def engine_stats(admin: admin_grpc.AdminServiceStub) -> list[dict[str, int]]:
    reply = admin.GetEngineStats(admin_pb.GetEngineStatsRequest(), timeout=20)
    assert all(r.ok for r in reply.results), reply
    return [json.loads(r.result_json) for r in reply.results]


def is_paused(admin: admin_grpc.AdminServiceStub) -> tuple[bool, list[str | None]]:
    reply = admin.IsPaused(admin_pb.IsPausedRequest(), timeout=20)
    return reply.is_paused, [json.loads(r.result_json)["paused"] for r in reply.results]


def wait_for_waiting(admin: admin_grpc.AdminServiceStub, expected: int) -> None:
    """Until the engines hold `expected` waiting requests (they queue while paused)."""
    deadline = time.monotonic() + 30
    while sum(s["num_waiting"] for s in engine_stats(admin)) < expected:
        assert time.monotonic() < deadline, engine_stats(admin)
        time.sleep(0.02)
    assert sum(s["num_waiting"] for s in engine_stats(admin)) == expected


def start_together(stub: pb_grpc.GenerateServiceStub,
                   admin: admin_grpc.AdminServiceStub) -> Streams:
    """NUM_STREAMS streams, each with its first tokens, running again from one moment.

    Streams started one by one could run to their end before the last one arrives (an
    engine steps in milliseconds, and one starved of CPU lags the other by a hundred
    steps). So they queue behind a keep pause, each engine runs alone until its streams
    have their first token and is frozen again, and then both resume at once."""
    pause(admin, admin_pb.PAUSE_MODE_KEEP)
    streams = Streams(stub, MAX_TOKENS)
    wait_for_waiting(admin, NUM_STREAMS)
    for engine in (0, 1):
        resume(admin, engine)
        streams.wait_until(lambda e=engine: all(streams.tokens[e::2]))
        pause(admin, admin_pb.PAUSE_MODE_KEEP, engine)
    resume(admin)
    return streams


def test_abort_ends_every_stream_with_its_tokens_and_queues_new_ones(
        stub: pb_grpc.GenerateServiceStub, admin: admin_grpc.AdminServiceStub) -> None:
    streams = start_together(stub, admin)
    paused_at = time.monotonic()
    results = pause(admin, admin_pb.PAUSE_MODE_ABORT)
    assert sum(r["num_aborted"] for r in results) == NUM_STREAMS  # type: ignore[misc]
    streams.wait_until(streams.all_finished, timeout=10)
    streams.join()
    assert set(streams.finish_reasons) == {PAUSED}
    ended_s = max(streams.finished_at) - paused_at
    print(f"\nabort: {NUM_STREAMS} streams ended {ended_s:.3f} s after the pause call, with "
          f"{min(map(len, streams.tokens))}..{max(map(len, streams.tokens))} tokens")
    # No bound on ended_s beyond the wait's 10 s: with two CPUs busy the 64 streams' ends
    # took 1.01 s once (a 1 s bound failed CI-like runs). That the abort cut them short,
    # not that they ran out, is what the token counts below show.
    for tokens, completion_tokens in zip(streams.tokens, streams.completion_tokens, strict=True):
        assert 1 <= len(tokens) < MAX_TOKENS and completion_tokens == len(tokens)
    assert is_paused(admin) == (True, ["abort", "abort"])

    later = Streams(stub, 3, count=2, first=NUM_STREAMS)
    wait_for_waiting(admin, 2)
    assert not any(later.tokens)
    resume(admin)
    later.join()
    assert later.finish_reasons == [LENGTH, LENGTH] and later.tokens[0] and later.tokens[1]


def test_wait_lets_running_streams_finish_and_holds_new_ones(
        stub: pb_grpc.GenerateServiceStub, admin: admin_grpc.AdminServiceStub) -> None:
    streams = start_together(stub, admin)
    results = pause(admin, admin_pb.PAUSE_MODE_WAIT)
    # The answer came once nothing ran any more: every stream has had its last token.
    assert [r["num_running"] for r in results] == [0, 0]
    later = Streams(stub, 3, count=1, first=NUM_STREAMS)
    streams.join()
    assert set(streams.finish_reasons) == {LENGTH}
    assert all(len(tokens) == MAX_TOKENS for tokens in streams.tokens)
    wait_for_waiting(admin, 1)
    assert not later.tokens[0]
    assert is_paused(admin) == (True, ["wait", "wait"])
    resume(admin)
    later.join()
    assert later.finish_reasons == [LENGTH] and len(later.tokens[0]) == 3
    assert is_paused(admin) == (False, [None, None])


def test_keep_freezes_streams_which_resume_as_if_never_paused(
        stub: pb_grpc.GenerateServiceStub, admin: admin_grpc.AdminServiceStub) -> None:
    reference = Streams(stub, MAX_TOKENS)
    reference.join()
    assert all(len(tokens) == MAX_TOKENS for tokens in reference.tokens)

    streams = start_together(stub, admin)
    results = pause(admin, admin_pb.PAUSE_MODE_KEEP)
    paused_at = time.monotonic()
    frozen = sum(r["num_running"] for r in results)  # type: ignore[misc]
    print(f"\nkeep: frozen with {min(map(len, streams.tokens))}.."
          f"{max(map(len, streams.tokens))} of {MAX_TOKENS} tokens seen by the client")
    assert frozen == NUM_STREAMS, results  # all mid-generation
    before = engine_stats(admin)
    # An interval to observe, not to synchronize: nothing may move during it. Outputs
    # made before the pause may still be on their way to the client in its first half.
    time.sleep(1.0)
    after = engine_stats(admin)
    assert [s["step_counter"] for s in after] == [s["step_counter"] for s in before]
    assert [s["num_running"] for s in after] == [s["num_running"] for s in before]
    assert not streams.arrived_between(paused_at + 0.5, time.monotonic())
    assert not any(streams.finish_reasons)
    resume(admin)
    streams.join()
    assert set(streams.finish_reasons) == {LENGTH}
    assert streams.tokens == reference.tokens
