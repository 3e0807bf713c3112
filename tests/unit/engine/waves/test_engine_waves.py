"""EngineCore in lockstep waves: two cores in one process whose runners meet at a
barrier on every forward pass and all-reduce, as expert-parallel ranks do."""

from __future__ import annotations

import queue
import threading
import time
from typing import Any

import pytest

from services.engine.config import EngineConfig
from services.engine.core.engine_core import EngineCore
from services.engine.core.iteration_details import IterationDetails
from services.engine.messages import SessionOutputs
from services.engine.request import FinishReason
from tests.unit.engine.fakes import LockstepRunner, collect, request, tokens


def wait_until_idle(cores: list[EngineCore]) -> list[Any]:
    """The ranks' wave states once no wave runs (a shutdown mid-wave would leave the
    other rank alone at the barrier)."""
    waves = [c.wave for c in cores]
    deadline = time.monotonic() + 10
    while any(w is not None and w.running for w in waves):
        assert time.monotonic() < deadline, "the wave did not end"
        time.sleep(0.01)
    return waves


@pytest.mark.timeout(60)
def test_idle_rank_runs_dummies_until_the_wave_ends_then_both_idle() -> None:
    barrier, votes = threading.Barrier(2), [False, False]
    runners = [LockstepRunner(barrier, votes, r) for r in range(2)]
    cores = [EngineCore(EngineConfig(engine_index=r), runners[r]) for r in range(2)]
    announced: list[tuple[int, int]] = []

    def relay(sender: int) -> object:
        def announce(wave: int) -> None:  # the coordinator's job, in miniature
            announced.append((sender, wave))
            for core in cores:
                core.start_wave(wave)
        return announce

    for r, core in enumerate(cores):
        core.join_waves(check_interval=4, announce=relay(r))  # type: ignore[arg-type]
    q = cores[0].sessions.open("s")
    for core in cores:
        core.start()
    try:
        cores[0].add_request(request("a", max_tokens=6))
        by_id, _ = collect(q, {"a"})
        assert tokens(by_id["a"]) == [4, 5, 6, 7, 8, 9]
        waves = wait_until_idle(cores)
        assert all(w is not None and w.wave == 1 for w in waves)
        assert announced == [(0, 0)]
        assert runners[1].dummy_steps >= 6 and runners[1].steps == 0
        # Idle: nothing steps any more (no spinning).
        counts = [(r.steps, r.dummy_steps) for r in runners]
        time.sleep(0.3)
        assert [(r.steps, r.dummy_steps) for r in runners] == counts
        # A request at the other rank starts the next wave everywhere.
        q1 = cores[1].sessions.open("t")
        cores[1].add_request(request("b", "t", max_tokens=2))
        by_id, _ = collect(q1, {"b"})
        assert by_id["b"][-1].finish_reason is FinishReason.LENGTH
        assert announced == [(0, 0), (1, 1)]
        assert runners[0].dummy_steps > counts[0][1]
    finally:
        barrier.abort()  # release a rank stuck at the barrier when the test fails
        for core in cores:
            core.shutdown()


@pytest.mark.timeout(60)
def test_throttled_ranks_start_requests_only_in_the_same_aligned_steps() -> None:
    """prefill_interval 4: requests that arrive mid-wave, at either rank, wait for the
    wave's next step 0, 4, 8, ... and both ranks prefill in exactly those steps."""
    barrier, votes = threading.Barrier(2), [False, False]
    runners = [LockstepRunner(barrier, votes, r) for r in range(2)]
    for runner in runners:
        runner.delay_s = 0.02  # steps long enough for arrivals to land mid-wave
    cores = [EngineCore(EngineConfig(engine_index=r), runners[r]) for r in range(2)]

    def announce(wave: int) -> None:
        for core in cores:
            core.start_wave(wave)

    queues = []
    for r, core in enumerate(cores):
        core.join_waves(check_interval=8, announce=announce, prefill_interval=4)
        queues.append(core.sessions.open(f"s{r}"))
        core.sessions.subscribe_details(f"s{r}")
        core.start()
    try:
        cores[0].add_request(request("a", "s0", max_tokens=60))  # a 1.2 s wave
        arrivals = {"b": 0, "c": 1, "d": 1, "e": 0}
        details: list[list[IterationDetails]] = [[], []]
        finished: set[str] = set()
        while len(finished) < 1 + len(arrivals):
            for r, q in enumerate(queues):
                try:
                    item = q.get(timeout=0.01)
                except queue.Empty:
                    continue
                if isinstance(item, IterationDetails):
                    details[r].append(item)
                elif isinstance(item, SessionOutputs):
                    finished |= {u.request_id for u in item.updates if u.finished}
            # One arrival every few steps of rank 0, at either rank.
            if arrivals and len(details[0]) >= 3 * (5 - len(arrivals)):
                rid, rank = next(iter(arrivals.items()))
                del arrivals[rid]
                cores[rank].add_request(request(rid, f"s{rank}", max_tokens=6))
        prefills = [(d.wave, d.wave_step) for rank in details for d in rank
                    if d.num_prefill_requests]
        assert len(prefills) >= 3, details
        assert all(step % 4 == 0 for _, step in prefills), prefills
        # Not only at a wave's start: some waited for a later aligned step.
        assert any(step > 0 for _, step in prefills), prefills
        assert {r for r, rank in enumerate(details) for d in rank
                if d.num_prefill_requests} == {0, 1}
        wait_until_idle(cores)
    finally:
        barrier.abort()
        for core in cores:
            core.shutdown()


class _Counting:
    """Drafts the fake model's own continuation (last + 1, ...): all accepted."""

    def propose(self, request: Any, num_tokens: int) -> list[int]:
        last = (request.output_token_ids or request.prompt_token_ids)[-1]
        return [(last + 1 + i) % 100 for i in range(num_tokens)]

    def forget(self, request_id: str) -> None:
        pass


@pytest.mark.timeout(60)
def test_speculation_in_a_wave_verifies_on_one_rank_while_the_other_runs_dummies() -> None:
    import json

    from services.engine.speculative.config import SpeculativeConfig
    from services.engine.speculative.speculator import Speculator

    barrier, votes = threading.Barrier(2), [False, False]
    runners = [LockstepRunner(barrier, votes, r) for r in range(2)]
    spec = json.dumps({"method": "ngram", "num_speculative_tokens": 3})
    cores = [EngineCore(EngineConfig(engine_index=r, speculative_config=spec), runners[r])
             for r in range(2)]
    for core in cores:
        core.scheduler.speculator = Speculator(SpeculativeConfig("ngram", 3), _Counting())

        def announce(wave: int) -> None:
            for c in cores:
                c.start_wave(wave)
        core.join_waves(check_interval=4, announce=announce)
    q = cores[0].sessions.open("s")
    for core in cores:
        core.start()
    try:
        cores[0].add_request(request("a", max_tokens=21))
        by_id, _ = collect(q, {"a"})
        assert tokens(by_id["a"]) == list(range(4, 25))
        wait_until_idle(cores)
        stats = cores[0].scheduler.stats().speculation
        assert stats is not None and stats.num_accepted_tokens == stats.num_draft_tokens > 0
        # 21 tokens in 1 + 5 steps (4 a verify step); the idle rank met each with a dummy.
        assert runners[0].steps == 6
        assert runners[1].steps == 0 and runners[1].dummy_steps >= 6
    finally:
        barrier.abort()
        for core in cores:
            core.shutdown()
