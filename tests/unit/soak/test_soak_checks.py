"""The soak driver's seeded plan and its invariants, on records made up here: each check
must fail on the violation it exists for (so a green soak means something)."""

from __future__ import annotations

import random
import time

from benchmarks.soak import faults, invariants
from benchmarks.soak.processes import ProcessRecord, Usage
from benchmarks.soak.traffic import (
    CHAT_DOORS,
    CLIENT_TIMEOUT,
    CONNECTION_LOST,
    DOORS,
    Outcome,
    RequestSpec,
    draw,
)


def spec(index: int = 0, door: str = "grpc_generate", greedy: bool = True,
         deadline_s: float | None = None, invalid: bool = False) -> RequestSpec:
    return RequestSpec(index, door, "p", 8, greedy, 1, False, (), "", False, deadline_s, None,
                       invalid)


def outcome(s: RequestSpec, code: str = "OK", texts: tuple[str, ...] = ("a",),
            started: float = 100.0, ended: float = 101.0, message: str = "why") -> Outcome:
    return Outcome(s, code, message, list(texts), started, ended)


def injected(started: float, ended: float, kind: str = "kill_engine") -> faults.Injected:
    return faults.Injected(faults.Fault(0.0, kind, 0), started, ended, "engine-0")


def test_one_seed_draws_the_same_requests_and_faults() -> None:
    def requests(seed: int) -> list[RequestSpec]:
        rng = random.Random(seed)
        return [draw(rng, i) for i in range(500)]

    assert requests(3) == requests(3) != requests(4)
    assert {s.door for s in requests(3)} == set(DOORS)
    assert all(s.constraint in ("", "json") for s in requests(3) if s.door in CHAT_DOORS)
    plan = faults.plan(random.Random(1), 100.0, 2, every_kind_once=True, mean_gap_s=0)
    assert sorted(f.kind for f in plan) == sorted(faults.KINDS)
    assert plan == faults.plan(random.Random(1), 100.0, 2, True, 0)
    assert all(0 < f.at_s < 100 for f in plan)
    long = faults.plan(random.Random(1), 3600.0, 2, every_kind_once=False, mean_gap_s=60)
    assert 30 < len(long) < 120 and all(f.at_s < 3600 for f in long)
    for seed in range(20):  # every kind in every long plan (seed 1 once drew no kill_engine)
        drawn = faults.plan(random.Random(seed), 600.0, 2, every_kind_once=False,
                            mean_gap_s=60)
        if len(drawn) >= len(faults.KINDS):
            assert {f.kind for f in drawn} == set(faults.KINDS)


def test_a_hang_and_a_late_end_fail_no_hang() -> None:
    ok = outcome(spec(0, deadline_s=1.0), "DEADLINE_EXCEEDED", started=0.0, ended=1.5)
    assert invariants.no_hang([ok], slack_s=2.0).ok
    assert not invariants.no_hang([outcome(spec(1), CLIENT_TIMEOUT)], 2.0).ok
    late = outcome(spec(2, deadline_s=1.0), "DEADLINE_EXCEEDED", started=0.0, ended=4.0)
    assert not invariants.no_hang([late], 2.0).ok


def test_unavailable_counts_only_near_a_fault() -> None:
    fault = [injected(100.0, 100.5)]
    near = outcome(spec(0), "UNAVAILABLE", started=99.0, ended=101.0)
    after = outcome(spec(1), CONNECTION_LOST, started=120.0, ended=121.0)
    far = outcome(spec(2), "UNAVAILABLE", started=200.0, ended=201.0)
    assert invariants.codes_allowed([near, after], fault, window_s=30.0).ok
    assert not invariants.codes_allowed([far], fault, window_s=30.0).ok
    assert not invariants.codes_allowed([outcome(spec(3), "INTERNAL")], fault, 30.0).ok
    silent = outcome(spec(4), "RESOURCE_EXHAUSTED", message="")
    assert not invariants.codes_allowed([silent], fault, 30.0).ok
    # A request bad on purpose must be refused as such, and nothing else may be.
    assert invariants.codes_allowed([outcome(spec(5, invalid=True), "INVALID_ARGUMENT")],
                                    fault, 30.0).ok
    assert not invariants.codes_allowed([outcome(spec(6, invalid=True), "OK")], fault, 30.0).ok
    assert not invariants.codes_allowed([outcome(spec(7), "INVALID_ARGUMENT")], fault, 30.0).ok


def test_a_changed_or_missing_greedy_text_fails() -> None:
    s = spec(0)
    key = s.reference_key
    assert invariants.texts_match([outcome(s, texts=("a",))], {key: "a"}).ok
    assert not invariants.texts_match([outcome(s, texts=("ab",))], {key: "a"}).ok
    assert not invariants.texts_match([outcome(s, texts=("a",))], {key: None}).ok
    # Sampled requests have no reference; chat and completion never share one.
    assert spec(1, greedy=False).reference_key is None
    assert spec(2, door="http_chat").reference_key != key
    assert spec(3, door="http_completion_stream").reference_key == key


def test_overload_refusals_need_a_retry_hint() -> None:
    refused = outcome(spec(0), "RESOURCE_EXHAUSTED")
    assert not invariants.retry_hints([refused]).ok
    refused.retry_hint = True
    assert invariants.retry_hints([refused]).ok


def test_a_held_block_a_left_request_or_a_leak_fails() -> None:
    clean = {"engine_index": 0, "num_blocks": 8, "num_free_blocks": 8, "num_running": 0,
             "num_waiting": 0, "state": "RUNNING"}
    assert invariants.engines_drained([clean]).ok
    assert not invariants.engines_drained([{**clean, "num_free_blocks": 7}]).ok
    assert not invariants.engines_drained([{**clean, "num_waiting": 1}]).ok
    assert not invariants.engines_drained([]).ok
    assert not invariants.frontend_drained(1.0).ok

    def record(rss: int, fds: int = 10, threads: int = 5, lived: float = 100.0
               ) -> ProcessRecord:
        return ProcessRecord("engine-0", 1, Usage(100, 10, 5),
                                        Usage(rss, fds, threads), lived)

    assert invariants.resources_flat([record(105)], 0.05, 60.0, 0, 0).ok
    assert not invariants.resources_flat([record(106)], 0.05, 60.0, 0, 0).ok
    assert not invariants.resources_flat([record(100, fds=11)], 0.05, 60.0, 0, 0).ok
    assert not invariants.resources_flat([record(100, threads=6)], 0.05, 60.0, 0, 0).ok
    assert invariants.resources_flat([record(200, lived=10.0)], 0.05, 60.0, 0, 0).ok


def test_metrics_must_match_the_clients_counts() -> None:
    assert invariants.metrics_agree({"samples finished": 3.0}, {"samples finished": 3.0}).ok
    assert not invariants.metrics_agree({"rejected INVALID_ARGUMENT": 2.0},
                                        {"rejected INVALID_ARGUMENT": 1.0}).ok
    assert not invariants.metrics_agree({}, {"rejected INTERNAL": 1.0}).ok


def test_a_process_that_grew_and_was_killed_is_still_judged(monkeypatch) -> None:
    # The hour-long run's longest-lived engine grew 306 -> 334 MiB and was then killed by
    # a fault: judging live processes only, the run never saw it.
    from benchmarks.soak import processes

    live = {"engine-0": 1}
    sizes = {1: 100, 2: 100}
    monkeypatch.setattr(processes, "roles", lambda cluster: dict(live))
    monkeypatch.setattr(processes, "usage", lambda pid: Usage(sizes[pid], 10, 5))
    sampler = processes.UsageSampler(cluster=None, log=lambda line: None,  # type: ignore[arg-type]
                                     log_every_s=1e9, every_s=1e9)
    try:
        sampler.sample()  # engine-0 (pid 1) is born
        sampler.warm_from(time.monotonic(), settle_s=0.0)
        sampler.sample()  # ... warm at 100
        sizes[1] = 120
        sampler.sample()  # ... grows
        live["engine-0"] = 2  # ... and a fault replaces it
        sizes.pop(1)
        sampler.sample()
        sampler.healed(time.monotonic())
        sampler.sample()  # the replacement, warm once the cluster served again
    finally:
        sampler.stop()
    by_pid = {r.pid: r for r in sampler.records()}
    assert by_pid[1].ended and by_pid[1].last.rss_bytes == 120
    assert not by_pid[2].ended
    assert not invariants.resources_flat(list(by_pid.values()), 0.05, 0.0, 0, 0).ok
