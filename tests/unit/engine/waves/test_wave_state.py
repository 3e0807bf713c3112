"""WaveState: lockstep waves of an expert-parallel group, simulated over several ranks."""

from __future__ import annotations

import pytest

from services.engine.waves.state import WaveState


def test_a_rank_with_work_starts_the_wave_and_asks_the_others() -> None:
    w = WaveState(check_interval=4)
    assert w.start_local() is True and w.running and w.wave == 0
    assert w.start_local() is False  # already running: no second message
    assert w.start(0) is False


def test_steps_check_every_interval_and_end_only_when_no_rank_has_work() -> None:
    w = WaveState(check_interval=3)
    w.start(0)
    assert [w.stepped(dummy=False) for _ in range(3)] == [False, False, True]
    assert w.agreed(any_rank_has_work=True) is False and w.running
    assert [w.stepped(dummy=True) for _ in range(3)] == [False, False, True]
    assert w.agreed(any_rank_has_work=False) is True
    assert not w.running and w.wave == 1 and w.num_dummy_steps == 3
    with pytest.raises(RuntimeError):
        w.stepped(dummy=True)


def test_stale_start_of_a_finished_wave_is_ignored() -> None:
    w = WaveState(check_interval=1)
    w.start(0)
    w.stepped(dummy=False)
    w.agreed(False)  # wave 0 is over here
    assert w.start(0) is False and not w.running  # a late relay of wave 0's start
    assert w.start(1) is True and w.wave == 1


def test_a_late_joiner_catches_up_to_a_later_wave() -> None:
    w = WaveState()
    assert w.start(5) is True and w.wave == 5


def simulate(work: list[list[int]], check_interval: int = 4,
             max_steps: int = 1000) -> tuple[list[WaveState], list[int]]:
    """Ranks stepping in lockstep: work[r][i] is how many steps of work rank r gets
    at global step i (a burst of requests); returns the states and the steps at
    which each wave ended."""
    ranks = [WaveState(check_interval) for _ in work]
    remaining = [0 for _ in work]
    ended: list[int] = []
    for step in range(max_steps):
        starts = set()
        for r, state in enumerate(ranks):
            arriving = work[r][step] if step < len(work[r]) else 0
            remaining[r] += arriving
            if remaining[r] and state.start_local():
                starts.add(state.wave)
        for wave in starts:  # the coordinator relays each start to every rank
            for state in ranks:
                state.start(wave)
        if not any(s.running for s in ranks):
            if step >= max(len(w) for w in work):
                return ranks, ended
            continue
        assert all(s.running for s in ranks) and len({s.wave for s in ranks}) == 1
        checks = []
        for r, state in enumerate(ranks):
            checks.append(state.stepped(dummy=remaining[r] == 0))
            remaining[r] = max(0, remaining[r] - 1)
        assert len(set(checks)) == 1  # the ranks agree at the same step
        if checks[0]:
            any_work = any(remaining)
            results = {s.agreed(any_work) for s in ranks}
            assert len(results) == 1
            if results.pop():
                ended.append(step)
    raise AssertionError("never idle")


def test_ranks_stay_in_lockstep_and_idle_after_the_last_request() -> None:
    # Rank 0 gets 10 steps of work at step 0 and 3 more at step 50; rank 1 none.
    work = [[10] + [0] * 49 + [3], [0] * 51]
    ranks, ended = simulate(work, check_interval=4)
    # Wave 0 ends at the first check after the work runs out (step 11), wave 1 after
    # the second burst; rank 1 ran dummy steps throughout.
    assert ended == [11, 53]
    assert all(s.wave == 2 and not s.running for s in ranks)
    assert ranks[1].num_dummy_steps == 16 and ranks[0].num_dummy_steps == 16 - 13


def test_prefills_are_admitted_every_interval_from_the_wave_start() -> None:
    w = WaveState(check_interval=8, prefill_interval=3)
    w.start(0)
    admits = []
    for _ in range(7):
        admits.append(w.admits)
        w.stepped(dummy=False)
    assert admits == [True, False, False, True, False, False, True]
    w.stepped(dummy=False)
    w.agreed(False)
    w.start(1)  # a new wave counts from its own start
    assert w.admits
    with pytest.raises(ValueError, match="prefill_interval"):
        WaveState(prefill_interval=0)
