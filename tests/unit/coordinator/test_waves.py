"""WaveHub: relaying wave starts between the ranks of an expert-parallel group."""

from __future__ import annotations

from services.coordinator.waves import WaveHub, WaveStart


def test_start_reaches_the_other_ranks_of_the_group_only() -> None:
    hub = WaveHub()
    q0, q1 = hub.subscribe("moe", 0), hub.subscribe("moe", 1)
    other = hub.subscribe("dense", 1)
    assert hub.announce("moe", WaveStart(wave=3, started_by=0)) == 1
    assert q1.get_nowait() == WaveStart(3, 0)
    assert q0.empty() and other.empty()


def test_late_subscriber_learns_the_latest_wave() -> None:
    hub = WaveHub()
    hub.announce("moe", WaveStart(wave=0, started_by=0))
    hub.announce("moe", WaveStart(wave=1, started_by=0))
    hub.announce("moe", WaveStart(wave=0, started_by=1))  # a stale one does not win
    late = hub.subscribe("moe", 2)
    assert late.get_nowait() == WaveStart(1, 0)
    assert late.empty()


def test_resubscribing_ends_the_old_stream_and_close_ends_all() -> None:
    hub = WaveHub()
    first = hub.subscribe("moe", 1)
    second = hub.subscribe("moe", 1)
    assert first.get_nowait() is None
    hub.unsubscribe("moe", 1, first)  # the old stream's cleanup leaves the new one
    assert hub.announce("moe", WaveStart(0, 0)) == 1
    hub.close()
    assert second.get_nowait() == WaveStart(0, 0) and second.get_nowait() is None
