"""Policies: preemption victims, and the priority policy preempting by importance."""

from __future__ import annotations

from services.engine.request import Request, RequestStatus
from services.engine.scheduler.policy import FcfsQueue, PriorityQueue
from tests.unit.engine.scheduler_helpers import make_request, make_scheduler, step


def ranked(rid: str, priority: int, arrival: float) -> Request:
    r = make_request(rid)
    r.priority, r.arrival_time = priority, arrival
    return r


def test_fcfs_victim_is_the_newest_running_request() -> None:
    running = [ranked("old", 0, 1.0), ranked("new", 0, 2.0)]
    assert FcfsQueue().pick_victim(running).request_id == "new"


def test_priority_victim_is_the_least_important_then_the_latest_arrival() -> None:
    q = PriorityQueue()
    running = [ranked("bulk", 9, 1.0), ranked("vip", -1, 2.0), ranked("std", 0, 3.0)]
    assert q.pick_victim(running).request_id == "bulk"
    running = [ranked("early", 5, 1.0), ranked("late", 5, 3.0), ranked("mid", 5, 2.0)]
    assert q.pick_victim(running).request_id == "late"
    same = [ranked("first", 5, 1.0), ranked("second", 5, 1.0)]
    assert q.pick_victim(same).request_id == "second"


def test_priority_keeps_running_sorted_so_the_victim_sorts_last() -> None:
    q = PriorityQueue()
    running: list[Request] = []
    for r in [ranked("bulk", 9, 1.0), ranked("vip", -1, 2.0), ranked("std", 0, 3.0),
              ranked("std2", 0, 4.0)]:
        q.place_running(running, r)
    assert [r.request_id for r in running] == ["vip", "std", "std2", "bulk"]
    assert q.pick_victim(running) is running[-1]


def test_priority_preempts_the_least_important_even_if_admitted_first() -> None:
    # 4 blocks of 2 tokens. "bulk" runs alone first; "vip" arrives a step later.
    s = make_scheduler(num_blocks=4, block_size=2, policy="priority")
    bulk = make_request("bulk", prompt_len=2, max_tokens=4)
    bulk.priority = 9
    s.add_request(bulk)
    step(s)
    vip = Request("vip", [50, 51, 52, 53], bulk.sampling, eos_token_ids=(0,), priority=0)
    s.add_request(vip)
    step(s)  # bulk: 3 tokens in 2 blocks; vip: 4 tokens in 2 blocks; none free
    # vip needs a third block. Served first, it can preempt bulk; served in
    # admission order, bulk would already be scheduled and vip would preempt itself.
    out, _ = step(s)
    assert [r.request_id for r in out.requests] == ["vip"]
    assert bulk.num_preemptions == 1 and bulk.status is RequestStatus.WAITING
    assert vip.num_preemptions == 0 and vip.status is RequestStatus.RUNNING
