"""serve's restart policy and supervision, on a fake clock and fake children: no process
is started."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry

from services.common.config import LEFT_OUT_EXIT
from services.common.restart_status import given_up_engines, read_status
from services.serve.restart_policy import RestartPolicy, RestartTracker, describe_exit
from services.serve.supervision import Child, Part, Supervision


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


class FakeChild(Child):
    """A child whose exit code the test sets; start() brings it back."""

    def __init__(self, name: str) -> None:
        super().__init__(name, [name])
        self.code: int | None = None
        self.starts = 0
        self.stops = 0

    def start(self) -> None:
        self.starts += 1
        self.code = None

    def exited(self) -> int | None:
        return self.code

    def stop(self, timeout: float) -> None:
        self.stops += 1
        if self.code is None:
            self.code = -15


POLICY = RestartPolicy(max_restarts=3, window_s=60, backoff_max_s=4)


def test_describe_exit_names_the_signal() -> None:
    assert describe_exit(1) == "code 1"
    assert describe_exit(-9) == "code -9 (SIGKILL)"
    assert describe_exit(-15) == "code -15 (SIGTERM)"
    assert describe_exit(-200) == "code -200 (signal 200)"


def test_backoff_doubles_up_to_the_cap_then_the_crash_loop_gives_up() -> None:
    clock = Clock()
    tracker = RestartTracker("engine-0", POLICY, clock)
    delays = []
    for _ in range(3):
        delays.append(tracker.on_exit("code 1"))
        clock.now += 1
    assert delays == [0.5, 1.0, 2.0]
    assert tracker.on_exit("code 1") is None  # the 4th exit within 60 s
    assert tracker.given_up and tracker.restarts == 3 and tracker.last_exit == "code 1"
    capped = RestartTracker("x", RestartPolicy(max_restarts=10, window_s=60, backoff_max_s=3),
                            clock)
    assert [capped.on_exit("code 1") for _ in range(5)] == [0.5, 1.0, 2.0, 3.0, 3.0]


def test_exits_older_than_the_window_are_forgotten() -> None:
    clock = Clock()
    tracker = RestartTracker("frontend", POLICY, clock)
    for _ in range(10):  # one exit every 61 s: never a crash loop, never a long wait
        assert tracker.on_exit("code -9 (SIGKILL)") == 0.5
        clock.now += 61
    assert tracker.restarts == 10 and not tracker.given_up


def test_zero_restarts_gives_up_at_the_first_exit() -> None:
    tracker = RestartTracker("engine-0", RestartPolicy(0, 60, 4), Clock())
    assert tracker.on_exit("code 1") is None and tracker.given_up


@pytest.mark.parametrize("bad", [dict(max_restarts=-1), dict(window_s=0),
                                 dict(backoff_max_s=0.1)])
def test_policy_is_validated(bad: dict[str, float]) -> None:
    with pytest.raises(ValueError):
        RestartPolicy(**{"max_restarts": 1, "window_s": 1.0, "backoff_max_s": 1.0, **bad})


def cluster(status: Path, moe: bool = False, engines: int = 2, policy: RestartPolicy = POLICY
            ) -> tuple[Supervision, dict[str, FakeChild], Clock, CollectorRegistry]:
    children = {n: FakeChild(n) for n in
                ["coordinator", *(f"engine-{i}" for i in range(engines)), "frontend"]}
    engine_children = [c for n, c in children.items() if n.startswith("engine")]
    parts = [Part("coordinator", [children["coordinator"]], essential=True),
             *([Part("engines", engine_children, essential=False)] if moe else
               [Part(c.name, [c], essential=False) for c in engine_children]),
             Part("frontend", [children["frontend"]], essential=True)]
    clock, registry = Clock(), CollectorRegistry()
    supervision = Supervision(parts, policy, status, registry, clock)
    for part in supervision.parts:
        supervision.start(part)
    return supervision, children, clock, registry


def restarts(registry: CollectorRegistry, part: str) -> float | None:
    return registry.get_sample_value("corestream:serve_restarts_total", {"part": part})


def test_a_killed_process_restarts_after_its_backoff_and_is_counted(tmp_path: Path) -> None:
    status = tmp_path / "restarts.json"
    supervision, children, clock, registry = cluster(status)
    assert restarts(registry, "coordinator") == 0  # every series exists at 0
    children["coordinator"].code = -9
    assert supervision.check() is None
    assert children["coordinator"].starts == 1  # not yet: the backoff
    clock.now += 0.5
    assert supervision.check() is None
    assert children["coordinator"].starts == 2
    assert restarts(registry, "coordinator") == 1
    assert read_status(status)[0].last_exit == "code -9 (SIGKILL)"
    assert supervision.check() is None and children["coordinator"].starts == 2


def test_a_crash_looping_engine_is_given_up_and_the_cluster_serves_on(tmp_path: Path) -> None:
    status = tmp_path / "restarts.json"
    supervision, children, clock, _ = cluster(status)
    engine = children["engine-1"]
    for _ in range(POLICY.max_restarts):
        engine.code = 1
        assert supervision.check() is None
        clock.now += 10
        assert supervision.check() is None
    assert engine.starts == 1 + POLICY.max_restarts and supervision.num_engines == 2
    engine.code = 1
    assert supervision.check() is None  # given up; engine-0 still serves
    assert supervision.num_engines == 1
    clock.now += 100
    assert supervision.check() is None and engine.starts == 1 + POLICY.max_restarts
    by_part = {p.part: p for p in read_status(status)}
    assert by_part["engine-1"].given_up and by_part["engine-1"].restarts == 3
    assert not by_part["engine-0"].given_up
    assert given_up_engines(str(status)) == ["engine-1"]  # what GetModelInfo reports
    assert given_up_engines("") == []
    # The last engine going the same way stops the cluster.
    supervision = Supervision(supervision.parts[:2] + supervision.parts[3:],
                              RestartPolicy(0, 60, 1), None, None, clock)
    children["engine-0"].code = 1
    assert supervision.check() == "no engine is left"


def test_a_crash_looping_frontend_stops_the_cluster(tmp_path: Path) -> None:
    status = tmp_path / "restarts.json"
    supervision, children, _, _ = cluster(status, policy=RestartPolicy(0, 60, 1))
    children["frontend"].code = 1
    assert "frontend is gone" in (supervision.check() or "")
    assert json.loads(status.read_text())[-1]["given_up"]


def test_an_moe_group_restarts_as_a_whole_with_a_fresh_rendezvous(tmp_path: Path) -> None:
    status = tmp_path / "restarts.json"
    supervision, children, clock, registry = cluster(status, moe=True)
    rendezvous: list[int] = []
    supervision.parts[1].before_restart = lambda: rendezvous.append(1)
    children["engine-1"].code = -9
    assert supervision.check() is None
    assert children["engine-0"].stops == 1  # the survivor cannot go on alone
    clock.now += 0.5
    assert supervision.check() is None
    assert children["engine-0"].starts == children["engine-1"].starts == 2
    assert rendezvous == [1] and restarts(registry, "engines") == 1


def test_an_moe_groups_later_rank_is_replaced_alone_its_first_takes_the_group(
        tmp_path: Path) -> None:
    supervision, children, clock, registry = cluster(tmp_path / "restarts.json", moe=True,
                                                     engines=3)
    group = supervision.parts[1]
    group.replaces_ranks = True
    rendezvous: list[int] = []
    group.before_restart = lambda: rendezvous.append(1)
    # A later rank: the others pause and re-form with its replacement (engine sentinel).
    children["engine-2"].code = -9
    assert supervision.check() is None
    assert [children[f"engine-{i}"].stops for i in range(3)] == [0, 0, 0]
    clock.now += 0.5
    assert supervision.check() is None
    assert [children[f"engine-{i}"].starts for i in range(3)] == [1, 1, 2]
    assert rendezvous == [] and restarts(registry, "engines") == 1
    # The first rank hosts the rendezvous: the whole group restarts, on a fresh one.
    children["engine-0"].code = -9
    assert supervision.check() is None
    assert [children[f"engine-{i}"].stops for i in range(3)] == [1, 1, 1]
    clock.now += 1.0
    assert supervision.check() is None
    assert [children[f"engine-{i}"].starts for i in range(3)] == [2, 2, 3]
    assert rendezvous == [1] and restarts(registry, "engines") == 2


def test_admin_stats_shows_each_engines_restarts_and_the_other_processes() -> None:
    from corestream.generate.v1 import admin_service_pb2 as admin_pb2

    from services.cli.admin import _with_restarts

    restarts = [admin_pb2.ProcessRestarts(part="coordinator", restarts=1,
                                          last_exit="code -9 (SIGKILL)"),
                admin_pb2.ProcessRestarts(part="engine-0"),
                admin_pb2.ProcessRestarts(part="engine-1", restarts=2, last_exit="code 1",
                                          given_up=True),
                admin_pb2.ProcessRestarts(part="frontend")]
    results = [{"engine_index": 0, "ok": True}, {"engine_index": 1, "ok": False}]
    shown = _with_restarts(results, restarts)
    assert shown[0] == {"engine_index": 0, "ok": True, "restarts": 0, "last_exit": ""}
    assert shown[1]["restarts"] == 2 and shown[1]["last_exit"] == "code 1"
    assert shown[2:] == [
        {"part": "coordinator", "ok": True, "restarts": 1, "last_exit": "code -9 (SIGKILL)",
         "given_up": False},
        {"part": "frontend", "ok": True, "restarts": 0, "last_exit": "", "given_up": False}]


def test_an_engine_that_refuses_its_configuration_stops_the_cluster_at_once(
    tmp_path: Path,
) -> None:
    # Exit code 2: the engine printed why its flags or checkpoint cannot work; the same
    # flags would fail again, and the other engines share them.
    supervision, children, clock, registry = cluster(tmp_path / "restarts.json")
    children["engine-1"].code = 2
    reason = supervision.check()
    assert reason is not None and "engine-1 cannot start" in reason
    assert supervision.config_error
    clock.now += 60
    assert children["engine-1"].starts == 1 and restarts(registry, "engine-1") == 0
    assert [s.part for s in read_status(tmp_path / "restarts.json") if s.given_up] == ["engine-1"]


def test_an_moe_groups_later_rank_not_replaced_leaves_the_others_serving(
        tmp_path: Path) -> None:
    """Restarts spent (here: off): a later rank that exits is left out, and the others
    go on (their sentinels re-form the group without it); the whole group's restart,
    once allowed again, brings it back."""
    status = tmp_path / "restarts.json"
    supervision, children, clock, registry = cluster(status, moe=True, engines=3,
                                                     policy=RestartPolicy(0, 60, 1))
    group = supervision.parts[1]
    group.replaces_ranks = True
    children["engine-1"].code = -9
    assert supervision.check() is None
    assert [children[f"engine-{i}"].stops for i in range(3)] == [0, 0, 0]
    assert group.left_out == [children["engine-1"]] and supervision.num_engines == 2
    clock.now += 100
    assert supervision.check() is None  # no restart, and the exit is not seen twice
    assert [children[f"engine-{i}"].starts for i in range(3)] == [1, 1, 1]
    assert restarts(registry, "engines") == 0
    assert not read_status(status)[1].given_up
    # The first rank going stops them all, and gives the group up (restarts are off).
    children["engine-0"].code = -9
    assert supervision.check() == "no engine is left"
    assert children["engine-2"].stops == 1


def test_an_moe_groups_rank_that_comes_back_too_late_is_left_out_not_restarted(
        tmp_path: Path) -> None:
    """A replacement that found the group gone on without it exits with LEFT_OUT_EXIT:
    starting it again would be refused the same way, so it is left out at once (not
    counted as a crash), and the others serve on."""
    supervision, children, clock, registry = cluster(tmp_path / "restarts.json", moe=True,
                                                     engines=3)
    group = supervision.parts[1]
    group.replaces_ranks = True
    children["engine-2"].code = LEFT_OUT_EXIT
    assert supervision.check() is None
    assert group.left_out == [children["engine-2"]] and supervision.num_engines == 2
    clock.now += 60
    assert supervision.check() is None
    assert [children[f"engine-{i}"].starts for i in range(3)] == [1, 1, 1]
    assert [children[f"engine-{i}"].stops for i in range(3)] == [0, 0, 0]
    assert restarts(registry, "engines") == 0
    # Another rank's crash is still a crash: it is replaced as before.
    children["engine-1"].code = -9
    assert supervision.check() is None
    clock.now += 0.5
    assert supervision.check() is None
    assert [children[f"engine-{i}"].starts for i in range(3)] == [1, 2, 1]
