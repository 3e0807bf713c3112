"""Re-forming a gloo group after a rank failed (`Collectives.reform`): with every rank,
and without the ones that never came back. Ranks are threads of this process, each with
a group of its own over one TCPStore on 127.0.0.1, as separate processes would be."""

from __future__ import annotations

import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

import pytest
import torch

from services.engine.parallel.collectives import Collectives, LeftOut, connect
from tests.integration.cluster import free_port

pytestmark = pytest.mark.timeout(120)

T = TypeVar("T")
TIMEOUT_S = 2.0


def on_threads(*calls: Callable[[], T]) -> list[T]:
    """Run the calls at once, one thread each; their results in order."""
    with ThreadPoolExecutor(len(calls)) as pool:
        return [f.result() for f in [pool.submit(c) for c in calls]]


def group_of(world: int) -> list[Collectives]:
    port = free_port()
    return on_threads(*[lambda r=r: connect(Collectives, r, world, "127.0.0.1", port, None,
                                            TIMEOUT_S) for r in range(world)])


def summed(groups: list[Collectives]) -> list[float]:
    """Each rank all-reduces (its first rank + 1): what every rank got."""
    return on_threads(*[lambda g=g: g.all_reduce(torch.tensor([g.first_rank + 1.0])).item()
                        for g in groups])


def test_the_group_goes_on_without_a_rank_that_never_came_back() -> None:
    port = free_port()
    groups = on_threads(*[lambda r=r: connect(Collectives, r, 3, "127.0.0.1", port, None,
                                              TIMEOUT_S) for r in range(3)])
    assert summed(groups) == [6.0] * 3
    survivors = [groups[0], groups[2]]  # rank 1 is gone
    asked: list[list[int]] = []

    def go_on(members: list[int]) -> str | None:
        asked.append(members)
        return None

    # Rank 2 is back first (as survivors are: they retried since the fault) and waits;
    # it does not decide, rank 0 does, at once, with the ranks that are back.
    with ThreadPoolExecutor(1) as pool:
        waiting = pool.submit(groups[2].reform, go_on)
        deadline = time.monotonic() + 10
        while not groups[0]._store.check(["epoch-1/arrived-2"]):
            assert time.monotonic() < deadline and not waiting.done()
            time.sleep(0.01)
        assert groups[0].reform(go_on) == 1 and waiting.result() == 1
    assert asked == [[0, 2]]
    assert [(g.rank, g.world_size, g.members) for g in survivors] == [(0, 2, [0, 2]),
                                                                    (1, 2, [0, 2])]
    assert summed(survivors) == [4.0, 4.0]
    # Rank 1's replacement comes too late: refused as it connects (before it would
    # load a model), saying so.
    with pytest.raises(LeftOut, match=r"rank 1 was left out .* ranks \[0, 2\]"):
        connect(Collectives, 1, 3, "127.0.0.1", port, None, TIMEOUT_S)
    # The smaller group re-forms again as itself after a later fault.
    assert on_threads(groups[0].reform, groups[2].reform) == [2, 2]
    assert summed(survivors) == [4.0, 4.0]


def test_a_group_that_cannot_go_on_smaller_waits_for_the_missing_rank() -> None:
    groups = group_of(3)
    why = "num_experts 8 is not divisible by the data-parallel size 2"
    with pytest.raises(TimeoutError,
                       match="the ranks back cannot go on without the others: num_experts 8"):
        groups[0].reform(lambda members: why)
    # The missing rank comes back after all: the whole group re-forms.
    epochs = on_threads(lambda: groups[0].reform(lambda members: why),
                        lambda: groups[1].reform(), lambda: groups[2].reform())
    assert epochs == [1, 1, 1]
    assert [(g.rank, g.world_size) for g in groups] == [(0, 3), (1, 3), (2, 3)]
    assert summed(groups) == [6.0] * 3


def test_without_leave_to_shrink_a_missing_rank_times_the_others_out() -> None:
    groups = group_of(2)
    with pytest.raises(TimeoutError, match=r"1 of 2 ranks are back for epoch 1 after 2 s"):
        groups[0].reform()
    assert (groups[0].rank, groups[0].world_size) == (0, 2)


def test_a_dropped_rank_fails_its_peers_collective_at_once_and_both_re_form() -> None:
    """A rank whose step failed drops its connections, so that a peer waiting in a
    collective it will not join fails now rather than at the group's timeout (a
    tensor-parallel engine's ranks after a failed step of their expert-parallel group)."""
    port = free_port()
    timeout_s = 60.0
    groups = on_threads(*[lambda r=r: connect(Collectives, r, 2, "127.0.0.1", port, None,
                                              timeout_s) for r in range(2)])
    with ThreadPoolExecutor(1) as pool:
        waiting = pool.submit(lambda: groups[0].all_reduce(torch.ones(4)))
        time.sleep(0.5)  # rank 0 is in the collective; rank 1 never joins it
        started = time.monotonic()
        groups[1].drop()
        with pytest.raises(RuntimeError):
            waiting.result(timeout=timeout_s)
    assert time.monotonic() - started < 10
    assert groups[1].formed  # dropped, not a replacement: it re-forms as itself
    assert on_threads(groups[0].reform, groups[1].reform) == [1, 1]
    assert summed(groups) == [3.0, 3.0]


def test_a_replacement_that_connects_before_the_survivor_re_forms_joins_the_next_epoch(
) -> None:
    """A TP worker's group re-forms only after its rank 0's group decided, which waits
    for the replacement engine, whose worker connects to this group first: the survivor
    moved the epoch on when its step failed, so the replacement does not form epoch 0
    alone."""
    port = free_port()
    groups = on_threads(*[lambda r=r: connect(Collectives, r, 2, "127.0.0.1", port, None,
                                              TIMEOUT_S) for r in range(2)])
    groups[0].move_epoch_on()
    groups[0].move_epoch_on()  # once per re-forming
    replacement = connect(Collectives, 1, 2, "127.0.0.1", port, None, TIMEOUT_S)
    assert not replacement.formed and replacement.epoch == 1
    assert on_threads(groups[0].reform, replacement.reform) == [1, 1]
    assert summed([groups[0], replacement]) == [3.0, 3.0]
