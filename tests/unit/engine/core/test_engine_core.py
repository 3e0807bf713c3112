"""EngineCore's loop, sessions, errors and shutdown, on a deterministic fake runner."""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Iterator

import pytest

from services.common.thread_names import native_thread_name
from services.engine.config import EngineConfig
from services.engine.core.engine_core import EngineCore
from services.engine.executor.protocol import Executor
from services.engine.messages import EngineState, SessionOutputs
from services.engine.request import (
    INTERNAL,
    INVALID_ARGUMENT,
    UNAVAILABLE,
    FinishReason,
    Request,
    RequestUpdate,
)
from services.engine.scheduler.output import RunnerOutput, SchedulerOutput
from tests.unit.engine.fakes import (
    FakeRunner,
    RecordingRunner,
    collect,
    prompt_of,
    real_request,
    request,
    run_core,
    tiny_runner_for_tests,
    tokens,
    varied_requests,
)


@pytest.fixture
def core() -> Iterator[EngineCore]:
    c = EngineCore(EngineConfig(), FakeRunner())
    yield c
    c.shutdown()


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_the_loop_thread_carries_its_name_to_the_os(core: EngineCore) -> None:
    core.start()
    tid = core._loop_thread.native_id  # noqa: SLF001
    assert tid is not None
    deadline = time.monotonic() + 10
    # The thread names itself as it starts, which may be just after start() returns.
    while native_thread_name(tid) != "engine-loop" and time.monotonic() < deadline:
        time.sleep(0.01)
    assert native_thread_name(tid) == "engine-loop"


@pytest.mark.timeout(30)
def test_requests_stream_batched_per_session(core: EngineCore) -> None:
    qa, qb = core.sessions.open("a"), core.sessions.open("b")
    core.start()
    core.add_request(request("a1", "a", (1, 2, 3)))
    core.add_request(request("a2", "a", (10, 11)))
    core.add_request(request("b1", "b", (20,), max_tokens=2))
    by_id, messages = collect(qa, {"a1", "a2"})
    assert tokens(by_id["a1"]) == [4, 5, 6, 7]
    assert tokens(by_id["a2"]) == [12, 13, 14, 15]
    assert by_id["a1"][-1].finish_reason is FinishReason.LENGTH
    # Both requests advance in the same steps: one message carries both.
    assert any(len(m.updates) == 2 for m in messages)
    assert all(m.state is EngineState.RUNNING for m in messages)
    by_id, _ = collect(qb, {"b1"})
    assert tokens(by_id["b1"]) == [21, 22]
    assert qa.empty()  # nothing of b's leaked into a


@pytest.mark.timeout(30)
def test_rejected_request_gets_error_output(core: EngineCore) -> None:
    q = core.sessions.open("s")
    core.start()
    core.add_request(request("long", prompt=tuple(range(1, 65))))
    by_id, _ = collect(q, {"long"})
    [u] = by_id["long"]
    assert u.finish_reason is FinishReason.ERROR and u.error_code == INVALID_ARGUMENT
    assert "max_model_len" in u.error_message


@pytest.mark.timeout(30)
def test_abort_stops_outputs_and_frees_blocks() -> None:
    runner = FakeRunner()
    core = EngineCore(EngineConfig(), runner)
    q = core.sessions.open("s")
    runner.gate = threading.Event()
    core.start()
    try:
        core.add_request(request("r", max_tokens=50))
        while runner.steps == 0:  # the first step is now blocked inside execute
            threading.Event().wait(0.01)
        core.abort_requests(["r"])
        runner.gate.set()
        by_id, _ = collect(q, {"r"})
        # The abort lands right after execute, so the step's sampled token is dropped.
        assert tokens(by_id["r"]) == []
        assert by_id["r"][-1].finish_reason is FinishReason.ABORT
        assert core.scheduler.kv_cache.num_free_blocks == runner.num_blocks
    finally:
        core.shutdown()


@pytest.mark.timeout(30)
def test_an_abort_never_reaches_a_request_that_reused_the_id_after_it(core: EngineCore) -> None:
    # The frontend aborts what is left of a call and at once sends the next call under
    # the same id (a client's request_id). The abort's early copy used to be applied
    # after the next step's execute, to whatever held the id then: the new request.
    q = core.sessions.open("s")
    core.start()
    core.abort_requests(["x"])  # the old "x": already over, or not here at all
    core.add_request(request("x", max_tokens=3))
    by_id, _ = collect(q, {"x"})
    assert tokens(by_id["x"]) == [4, 5, 6]
    assert by_id["x"][-1].finish_reason is FinishReason.LENGTH
    # An abort still reaches a request added before it that the loop has not taken yet.
    core.add_request(request("y", max_tokens=50))
    core.abort_requests(["y"])
    by_id, _ = collect(q, {"y"})
    assert by_id["y"][-1].finish_reason is FinishReason.ABORT


@pytest.mark.timeout(30)
def test_execute_failure_kills_engine_and_fails_requests() -> None:
    runner = FakeRunner()
    runner.fail = True
    core = EngineCore(EngineConfig(), runner)
    states: list[EngineState] = []
    core.add_state_listener(states.append)
    q, other = core.sessions.open("s"), core.sessions.open("other")
    core.start()
    try:
        core.add_request(request("r"))
        by_id, _ = collect(q, {"r"})
        last = by_id["r"][-1]
        assert last.error_code == UNAVAILABLE and "device lost" in last.error_message
        assert "engine-core dp=0 is dead" in last.error_message
        assert states[-1] is EngineState.DEAD and "device lost" in core.death_reason
        # The sentinel paused and retried the step max_step_faults times first.
        assert states.count(EngineState.PAUSED_FAULT) == EngineConfig().max_step_faults == 3
        assert runner.steps == 4
        seen = []
        while not seen or seen[-1] is not EngineState.DEAD:
            msg = other.get(timeout=5)
            assert isinstance(msg, SessionOutputs) and not msg.updates
            seen.append(msg.state)
        assert set(seen) == {EngineState.PAUSED_FAULT, EngineState.RUNNING, EngineState.DEAD}
        core.add_request(request("late"))
        by_id, _ = collect(q, {"late"})
        assert by_id["late"][-1].error_code == UNAVAILABLE
    finally:
        core.shutdown()
    core._loop_thread.join(5)  # it closes the executor after telling the Sessions
    assert runner.closed_on == ["engine-loop"]


@pytest.mark.timeout(30)
def test_shutdown_drains_then_stops() -> None:
    runner = FakeRunner()
    core = EngineCore(EngineConfig(), runner)
    q = core.sessions.open("s")
    core.start()
    core.add_request(request("r", max_tokens=5))
    core.shutdown(drain_timeout_s=5)
    assert core.state is EngineState.STOPPED
    by_id, messages = collect(q, {"r"})
    assert by_id["r"][-1].finish_reason is FinishReason.LENGTH
    states = [m.state for m in messages]
    while isinstance(m := q.get(timeout=5), SessionOutputs):
        states.append(m.state)
    assert states[-1] is EngineState.STOPPED
    assert not core._loop_thread.is_alive()
    assert runner.closed_on == ["engine-loop"]  # once the loop was done with it


@pytest.mark.timeout(30)
def test_shutdown_without_drain_fails_inflight_requests() -> None:
    runner = FakeRunner()
    core = EngineCore(EngineConfig(), runner)
    q = core.sessions.open("s")
    core.start()
    core.add_request(request("r", max_tokens=1000 // 20))
    core.shutdown()
    by_id, _ = collect(q, {"r"})
    last = by_id["r"][-1]
    assert last.finished
    if last.finish_reason is FinishReason.ERROR:
        assert last.error_code == UNAVAILABLE


@pytest.mark.timeout(30)
def test_drain_refuses_new_requests_and_aborts_leftovers() -> None:
    runner = FakeRunner(max_model_len=64)
    runner.delay_s = 0.05  # 40 steps take 2 s, longer than the drain
    core = EngineCore(EngineConfig(), runner)
    q = core.sessions.open("s")
    core.start()
    core.add_request(request("slow", max_tokens=40))
    stopper = threading.Thread(target=core.shutdown, kwargs={"drain_timeout_s": 0.5})
    stopper.start()
    while core.state is not EngineState.DRAINING:
        time.sleep(0.01)
    core.add_request(request("late"))
    stopper.join(10)
    by_id, _ = collect(q, {"slow", "late"})
    assert by_id["late"][-1].error_code == UNAVAILABLE
    assert "draining" in by_id["late"][-1].error_message
    assert by_id["slow"][-1].error_code == UNAVAILABLE
    assert "shutting down" in by_id["slow"][-1].error_message
    assert core.state is EngineState.STOPPED and core.stats.kv_cache_usage == 0


@pytest.mark.timeout(30)
def test_watchdog_kills_a_stuck_loop_but_not_an_idle_one() -> None:
    runner = FakeRunner()
    core = EngineCore(EngineConfig(watchdog_timeout=0.3), runner)
    q = core.sessions.open("s")
    core.start()
    try:
        threading.Event().wait(1.0)  # idle for 3x the timeout
        assert core.state is EngineState.RUNNING
        core.add_request(request("ok", max_tokens=2))
        collect(q, {"ok"})
        runner.gate = threading.Event()  # the next step never returns (until the end)
        core.add_request(request("stuck"))
        started = time.monotonic()
        while not isinstance(msg := q.get(timeout=5), SessionOutputs) or \
                msg.state is not EngineState.DEAD:
            pass
        detected_s = time.monotonic() - started
        print(f"watchdog detection: {detected_s:.2f} s (timeout 0.3 s)")
        assert detected_s < 0.3 + 1.0
        assert "watchdog" in core.death_reason
        # Closed while the loop is still stuck in execute: a TP executor must stop
        # its workers then, so the watchdog's thread does it.
        deadline = time.monotonic() + 5
        while not runner.closed_on and time.monotonic() < deadline:
            time.sleep(0.01)
        assert runner.closed_on == ["engine-watchdog"] and not runner.gate.is_set()
    finally:
        if runner.gate is not None:
            runner.gate.set()
        core.shutdown(join_timeout_s=2)
    assert core.state is EngineState.DEAD  # final, even after the loop came back
    assert runner.closed_on == ["engine-watchdog"]  # once


@pytest.mark.timeout(30)
def test_a_request_that_breaks_the_scheduler_fails_alone(core: EngineCore) -> None:
    q = core.sessions.open("s")
    core.start()
    bad = request("bad")
    bad.prompt_token_ids = None  # type: ignore[assignment]
    core.add_request(bad)
    core.add_request(request("good", max_tokens=2))
    by_id, _ = collect(q, {"bad", "good"})
    assert by_id["bad"][-1].error_code == INTERNAL
    assert by_id["good"][-1].finish_reason is FinishReason.LENGTH
    assert core.state is EngineState.RUNNING


# ---- the real tiny model ------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny_runner() -> Executor:
    return tiny_runner_for_tests()


@pytest.mark.timeout(60)
def test_real_tiny_runner_matches_itself_across_batching(tiny_runner: Executor) -> None:
    prompt = (1, 17, 42, 99, 7, 3, 250, 11, 64, 5, 8)
    # A small token budget forces chunked prefill and mixed batches.
    alone, _ = run_core(tiny_runner, [real_request("alone", prompt, 6)],
                        max_num_batched_tokens=8)
    both, _ = run_core(tiny_runner, [real_request("x", prompt, 6),
                                     real_request("y", (1, 2, 3), 6)], max_num_batched_tokens=8)
    assert tokens(both["x"]) == tokens(alone["alone"])
    assert all(0 <= t < tiny_runner.model_info.vocab_size for t in tokens(both["y"]))


@pytest.mark.timeout(60)
def test_prefix_cache_hit_skips_recompute_and_matches_a_cold_run(
    tiny_runner: Executor,
) -> None:
    vocab = tiny_runner.model_info.vocab_size
    shared = prompt_of(64, 1, vocab)
    second_prompt = shared + (9, 10, 11, 12, 13)
    warm = RecordingRunner(tiny_runner)
    warm_out, core = run_core(warm, [real_request("first", shared + (5, 6, 7))],
                              [real_request("second", second_prompt)])
    assert warm_out["second"][0].num_cached_tokens == 64
    assert warm_out["first"][0].num_cached_tokens == 0
    # 5 new prompt tokens, then one token per decode step after the first.
    assert warm.num_fed["second"] == 5 + 7
    stats = core.scheduler.stats()
    assert (stats.prefix_cache_queries, stats.prefix_cache_hits) == (67 + 69, 64)

    cold = RecordingRunner(tiny_runner)
    cold_out, _ = run_core(cold, [real_request("cold", second_prompt)])
    assert cold.num_fed["cold"] == 69 + 7
    assert tokens(warm_out["second"]) == tokens(cold_out["cold"])


@pytest.mark.timeout(60)
def test_chunked_prefill_matches_unchunked(tiny_runner: Executor) -> None:
    vocab = tiny_runner.model_info.vocab_size
    whole, _ = run_core(tiny_runner, varied_requests(vocab), max_num_batched_tokens=2048)
    chunked, _ = run_core(tiny_runner, varied_requests(vocab), max_num_batched_tokens=16)
    assert {k: tokens(v) for k, v in chunked.items()} == {k: tokens(v) for k, v in whole.items()}


@pytest.mark.timeout(60)
@pytest.mark.parametrize("sampling", [{}, {"temperature": 0.9, "seed": 1234}],
                         ids=["greedy", "seeded"])
def test_preemption_matches_no_preemption(tiny_runner: Executor,
                                          sampling: dict[str, object]) -> None:
    vocab = tiny_runner.model_info.vocab_size
    roomy, _ = run_core(tiny_runner, varied_requests(vocab, **sampling))
    # 6 blocks of 16 tokens for four requests that end at up to 52 tokens (4 blocks).
    tight = RecordingRunner(tiny_runner, num_blocks=6)
    squeezed, _ = run_core(tight, varied_requests(vocab, **sampling))
    assert tight.num_preemptions > 0
    assert {k: tokens(v) for k, v in squeezed.items()} == {k: tokens(v) for k, v in roomy.items()}


# ---- the batch queue (max_concurrent_batches > 1) ------------------------------------


@pytest.mark.timeout(30)
def test_batch_queue_schedules_the_next_step_while_one_executes() -> None:
    runner = FakeRunner()
    core = EngineCore(EngineConfig(max_concurrent_batches=2), runner)
    q = core.sessions.open("s")
    runner.gate = threading.Event()
    core.start()
    try:
        core.add_request(request("first", max_tokens=3))
        while runner.steps == 0:  # the first batch is blocked inside execute
            time.sleep(0.01)
        core.add_request(request("second", prompt=(7, 8), max_tokens=3))
        deadline = time.monotonic() + 10
        while core.scheduler.requests.get("second") is None or \
                core.scheduler.requests["second"].num_inflight_tokens == 0:
            assert time.monotonic() < deadline, "the second batch was not scheduled ahead"
            time.sleep(0.01)
        assert runner.steps == 1  # scheduled while the first still executes
        runner.gate.set()
        by_id, _ = collect(q, {"first", "second"})
        assert tokens(by_id["first"]) == [4, 5, 6]
        assert tokens(by_id["second"]) == [9, 10, 11]
    finally:
        runner.gate.set()
        core.shutdown()


@pytest.mark.timeout(30)
def test_batch_queue_applies_aborts_before_the_outputs_of_the_executing_step() -> None:
    runner = FakeRunner()
    core = EngineCore(EngineConfig(max_concurrent_batches=2), runner)
    q = core.sessions.open("s")
    runner.gate = threading.Event()
    core.start()
    try:
        core.add_request(request("r", max_tokens=50))
        core.add_request(request("keep", prompt=(30,), max_tokens=2))
        while runner.steps == 0:
            time.sleep(0.01)
        core.abort_requests(["r"])
        runner.gate.set()
        by_id, _ = collect(q, {"r", "keep"})
        assert tokens(by_id["r"]) == []
        assert by_id["r"][-1].finish_reason is FinishReason.ABORT
        assert tokens(by_id["keep"]) == [31, 32]
        deadline = time.monotonic() + 5
        while core.scheduler.kv_cache.num_free_blocks != runner.num_blocks:
            assert time.monotonic() < deadline
            time.sleep(0.01)
    finally:
        runner.gate.set()
        core.shutdown()


@pytest.mark.timeout(120)
@pytest.mark.parametrize("sampling", [{}, {"temperature": 0.9, "seed": 1234},
                                      {"logprobs": 2, "prompt_logprobs": 1}],
                         ids=["greedy", "seeded", "logprobs"])
def test_batch_queue_outputs_equal_depth_one(tiny_runner: Executor,
                                             sampling: dict[str, object]) -> None:
    vocab = tiny_runner.model_info.vocab_size

    def run(depth: int, num_blocks: int | None) -> dict[str, list[RequestUpdate]]:
        requests = varied_requests(vocab, **sampling)
        out, _ = run_core(RecordingRunner(tiny_runner, num_blocks=num_blocks), requests,
                          max_num_batched_tokens=16, max_concurrent_batches=depth)
        return out

    def seen(results: dict[str, list[RequestUpdate]]) -> dict[str, object]:
        # Tokens and ranks exactly; log-probabilities to float32 rounding, since
        # other batch shapes sum in another order.
        return {k: ([t for u in v for t in u.new_token_ids],
                    [(lp.token_id, lp.rank, pytest.approx(lp.logprob, abs=1e-4),
                      [(t, pytest.approx(p, abs=1e-4)) for t, p in lp.top])
                     for u in v for lp in [*u.prompt_logprobs, *u.new_logprobs]])
                for k, v in results.items()}

    expected = seen(run(1, None))
    assert seen(run(2, None)) == expected
    # A small cache: preemptions of requests whose batch is still in flight.
    assert seen(run(2, 6)) == expected


@pytest.mark.timeout(120)
def test_preemption_keeps_prompt_logprobs_exact(tiny_runner: Executor) -> None:
    # Preempted requests lose their cache and recompute: the prompt logprobs they return
    # must be those of an unpreempted run, each position exactly once, whether they were
    # preempted after their prompt or in the middle of its chunked prefill.
    vocab = tiny_runner.model_info.vocab_size

    class PrefillPreemptions(RecordingRunner):
        """Also counts preemptions of requests that had not finished their prompt."""

        num_in_prefill = 0

        def execute(self, out: SchedulerOutput) -> RunnerOutput:
            self.num_in_prefill += sum(
                r.start_pos < self._end.get(r.request_id, 0) and not r.output_token_ids
                for r in out.requests
            )
            return super().execute(out)

    def requests() -> list[Request]:
        # a and b: at 16 tokens a step, b is still in its prefill when a's decodes need
        # a fourth block of the six, so b is preempted with part of its prompt done.
        return [*varied_requests(vocab, prompt_logprobs=2),
                real_request("a", prompt_of(46, 1, vocab), 12, prompt_logprobs=2),
                real_request("b", prompt_of(40, 2, vocab), 12, prompt_logprobs=2)]

    def seen(results: dict[str, list[RequestUpdate]]) -> dict[str, object]:
        return {k: ([t for u in v for t in u.new_token_ids],
                    [(lp.token_id, lp.rank, pytest.approx(lp.logprob, abs=1e-4),
                      [(t, pytest.approx(p, abs=1e-4)) for t, p in lp.top])
                     for u in v for lp in u.prompt_logprobs])
                for k, v in results.items()}

    roomy, _ = run_core(tiny_runner, requests(), max_num_batched_tokens=16)
    # The last two requests run alone, after the first four.
    tight = PrefillPreemptions(tiny_runner, num_blocks=6)
    squeezed, _ = run_core(tight, requests()[:4], requests()[4:], max_num_batched_tokens=16)
    assert tight.num_preemptions > tight.num_in_prefill > 0
    expected = seen(roomy)
    for r in requests():
        logprobs = expected[r.request_id][1]  # type: ignore[index]
        assert [lp[0] for lp in logprobs] == r.prompt_token_ids[1:], r.request_id
    assert seen(squeezed) == expected


def test_the_cpu_kv_cache_is_zero_aligned_and_committed_only_when_used() -> None:
    import torch

    from services.engine.worker.config import RunnerConfig
    from services.engine.worker.model_runner import ModelRunner as TorchModelRunner

    def rss_mib() -> int:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * 4096 >> 20

    before = rss_mib()
    runner = TorchModelRunner(RunnerConfig(kv_cache_memory="1GiB", dtype="bfloat16"))
    caches = runner.kv_caches
    assert sum(c.numel() * c.element_size() for c in caches) > 900 << 20
    # Not written, so not resident: the budget is a ceiling, not an up-front cost.
    assert rss_mib() - before < 256
    for cache in caches:
        assert cache.dtype is torch.bfloat16 and cache.is_contiguous()
        assert cache.data_ptr() % 64 == 0
    assert not caches[0][:, :8].any() and not caches[-1][:, -8:].any()
