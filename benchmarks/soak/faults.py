"""The soak's faults: a seeded schedule, and how each is done to a live cluster.

Every kind is a way a production cluster fails: a process killed (an engine, the
coordinator, the frontend, a tensor-parallel worker), an engine frozen past the watchdog
(SIGSTOP, then SIGCONT), an engine step that raises (the engine is started with the
test-only fault `raise_on_sigusr2`: each SIGUSR2 makes its next step raise once), and a
burst of requests past the admission limit. serve heals the killed processes; the
invariants (invariants.py) say whether anything was lost on the way.
"""

from __future__ import annotations

import os
import random
import signal
import time
from dataclasses import dataclass

from benchmarks.soak.processes import roles
from tests.integration.cluster import Cluster

KINDS = ("kill_engine", "kill_coordinator", "kill_frontend", "kill_tp_worker",
         "stop_engine", "step_raises", "admission_burst")


@dataclass(frozen=True)
class Fault:
    at_s: float
    """Seconds after the traffic started."""
    kind: str
    engine: int
    """The engine it targets (engine faults only)."""


@dataclass
class Injected:
    fault: Fault
    started: float
    """time.monotonic() when it was done."""
    ended: float
    target: str
    """role and pid, or what was sent."""
    error: str = ""
    killed: int | None = None
    """The pid a kill ended (and, for a tensor-parallel worker, its engine's: the engine
    dies with it)."""


def plan(rng: random.Random, duration_s: float, num_engines: int,
         every_kind_once: bool, mean_gap_s: float) -> list[Fault]:
    """Faults over the run: in CI mode each kind once, in a seeded order spread evenly;
    otherwise at seeded, exponentially spaced times, the kinds in shuffled rounds (each
    kind once a round), so that a run of a round's length or more has every kind (seed 1
    of the hour-long run drew 25 faults by independent choice and no kill_engine)."""
    if every_kind_once:
        kinds = list(KINDS)
        rng.shuffle(kinds)
        gap = duration_s / (len(kinds) + 1)
        return [Fault(gap * (i + 1), kind, rng.randrange(num_engines))
                for i, kind in enumerate(kinds)]
    faults: list[Fault] = []
    round_: list[str] = []
    at = rng.expovariate(1 / mean_gap_s)
    while at < duration_s:
        if not round_:
            round_ = list(KINDS)
            rng.shuffle(round_)
        faults.append(Fault(at, round_.pop(), rng.randrange(num_engines)))
        at += rng.expovariate(1 / mean_gap_s)
    return faults


def inject(fault: Fault, cluster: Cluster, freeze_s: float) -> Injected:
    """Do `fault` (not the burst: the driver sends that as traffic). Blocks for the
    freeze of stop_engine."""
    started = time.monotonic()
    live = roles(cluster)
    role = {"kill_coordinator": "coordinator", "kill_frontend": "frontend",
            "kill_tp_worker": f"engine-{fault.engine}-worker-0"}.get(
                fault.kind, f"engine-{fault.engine}")
    pid = live.get(role)
    if pid is None:
        # Still being restarted after an earlier fault: nothing to hit this time.
        return Injected(fault, started, time.monotonic(), role, f"no live {role}")
    sig = {"stop_engine": signal.SIGSTOP, "step_raises": signal.SIGUSR2}.get(
        fault.kind, signal.SIGKILL)
    os.kill(pid, sig)
    if fault.kind == "stop_engine":
        time.sleep(freeze_s)
        os.kill(pid, signal.SIGCONT)
    killed = None
    if sig == signal.SIGKILL:
        killed = live.get(f"engine-{fault.engine}") if fault.kind == "kill_tp_worker" else pid
    return Injected(fault, started, time.monotonic(), f"{role} (pid {pid})", killed=killed)
