from __future__ import annotations

import threading
import time

from services.coordinator.registry import EngineRegistry


def test_register_update_remove_bump_generation() -> None:
    reg = EngineRegistry()
    g0 = reg.snapshot().generation
    eid = reg.register(0, "127.0.0.1:1", "m", 128, state=2)
    s1 = reg.snapshot()
    assert s1.generation > g0 and [e.engine_id for e in s1.engines] == [eid]
    assert reg.update(eid, num_waiting=1, num_running=2, kv_cache_usage=0.5, state=2,
                      step_counter=10)
    s2 = reg.snapshot()
    assert s2.generation > s1.generation
    assert (s2.engines[0].num_waiting, s2.engines[0].num_running) == (1, 2)
    reg.remove(eid)
    assert reg.snapshot().engines == ()
    assert not reg.update(eid, num_waiting=0, num_running=0, kv_cache_usage=0, state=2,
                          step_counter=11)


def test_unchanged_load_does_not_wake_watchers() -> None:
    reg = EngineRegistry()
    eid = reg.register(0, "a:1", "m", 128, state=2)
    reg.update(eid, num_waiting=0, num_running=1, kv_cache_usage=0.1, state=2, step_counter=1)
    g = reg.snapshot().generation
    reg.update(eid, num_waiting=0, num_running=1, kv_cache_usage=0.1, state=2, step_counter=2)
    assert reg.snapshot().generation == g
    assert reg.snapshot().engines[0].step_counter == 2


def test_reregistration_from_same_address_replaces_entry() -> None:
    reg = EngineRegistry()
    reg.register(0, "a:1", "m", 128, state=2)
    eid2 = reg.register(0, "a:1", "m", 128, state=2)
    assert [e.engine_id for e in reg.snapshot().engines] == [eid2]


def test_wait_for_change_wakes_on_register() -> None:
    reg = EngineRegistry()
    g = reg.snapshot().generation
    threading.Timer(0.05, reg.register, args=(1, "b:2", "m", 64), kwargs={"state": 2}).start()
    start = time.monotonic()
    snap = reg.wait_for_change(g, timeout=5.0)
    assert snap.generation > g and len(snap.engines) == 1
    assert time.monotonic() - start < 4.0


def test_close_wakes_watchers() -> None:
    reg = EngineRegistry()
    threading.Timer(0.05, reg.close).start()
    start = time.monotonic()
    reg.wait_for_change(reg.snapshot().generation, timeout=5.0)
    assert reg.closed and time.monotonic() - start < 4.0


class _Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_silent_engines_expire_after_the_lease() -> None:
    clock = _Clock()
    reg = EngineRegistry(clock=clock)
    quiet = reg.register(0, "a:1", "m", 128, state=2, max_num_seqs=8)
    chatty = reg.register(1, "b:1", "m", 128, state=2)
    assert reg.snapshot().engines[0].max_num_seqs == 8
    clock.now += 3.0
    # An unchanged report renews the lease without waking watchers.
    reg.update(chatty, num_waiting=0, num_running=0, kv_cache_usage=0.0, state=0,
               step_counter=1)
    assert reg.expire(lease_s=5.0) == []
    clock.now += 3.0
    g = reg.snapshot().generation
    assert [e.engine_id for e in reg.expire(lease_s=5.0)] == [quiet]
    snap = reg.snapshot()
    assert [e.engine_id for e in snap.engines] == [chatty] and snap.generation > g
    # The expired engine's next report is refused, so it registers again.
    assert not reg.update(quiet, num_waiting=0, num_running=0, kv_cache_usage=0.0, state=2,
                          step_counter=2)
    back = reg.register(0, "a:1", "m", 128, state=2)
    assert {e.engine_id for e in reg.snapshot().engines} == {chatty, back}
