"""The processes of `corestream serve` and their supervision: a child that exits without
being asked to is restarted as its part's RestartTracker says (services/serve/restart_policy.py).

Everything here runs on serve's main thread: PR_SET_PDEATHSIG fires when the *thread*
that started a child ends, so a child started from a helper thread would get
SIGTERM as soon as that thread returned.
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from prometheus_client import CollectorRegistry, Counter

from services.common.config import CONFIG_ERROR_EXIT, LEFT_OUT_EXIT
from services.common.metrics import PREFIX
from services.common.parent_death import child_env
from services.common.restart_status import PartStatus, write_status
from services.serve.restart_policy import (
    RestartPolicy,
    RestartTracker,
    describe_exit,
)

log = logging.getLogger("services.serve")

# The ranks left of a broken MoE group are restarted with it; they cannot finish a
# collective without the dead rank, so they get little time to drain.
GROUP_STOP_S = 5.0
# NOTE: a rank other than the first of an MoE group is replaced alone: the others pause
# (their sentinel) and re-form the group with the new process. The first rank hosts the
# group's rendezvous store, which the others cannot reach again once it is gone: the
# whole group restarts then, on a fresh port.


@dataclass
class Child:
    name: str
    argv: list[str]
    proc: subprocess.Popen[bytes] | None = field(default=None)

    def start(self) -> None:
        cmd = [sys.executable, "-m", "services.cli", *self.argv]
        log.info("starting %s: %s", self.name, " ".join(self.argv))
        # A session of its own: a terminal's Ctrl-C reaches serve alone, which
        # then stops the children in order.
        # Children get SIGTERM if serve itself is killed, even with SIGKILL (set up by the
        # child: see services/common/parent_death.py).
        self.proc = subprocess.Popen(cmd, start_new_session=True,
                                     env={**os.environ, **child_env()})

    def exited(self) -> int | None:
        return None if self.proc is None else self.proc.poll()

    def stop(self, timeout: float) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            log.warning("%s did not exit within %.0fs of SIGTERM; killing it", self.name, timeout)
            self.proc.kill()
            self.proc.wait()


@dataclass
class Part:
    """What serve restarts as one: a process, or an MoE group (all its ranks)."""

    name: str
    children: list[Child]
    essential: bool
    """The cluster cannot serve without it (coordinator, frontend)."""
    before_restart: Callable[[], None] | None = None
    """Run before each restart (an MoE group takes a fresh rendezvous port)."""
    replaces_ranks: bool = False
    """An MoE group whose ranks but the first are replaced alone (see above)."""
    restart_at: float | None = None
    replacing: list[Child] | None = None
    """The children the pending restart replaces alone (None: all of them)."""
    left_out: list[Child] = field(default_factory=list)
    """Ranks of an MoE group that exited and were not replaced (restarts spent): the
    others go on without them; a restart of the whole group brings them back."""

    @property
    def is_engine(self) -> bool:
        return not self.essential

    def config_error(self) -> bool:
        """Whether a child exited with CONFIG_ERROR_EXIT: it refused its flags or its
        checkpoint (its one line says which), and would refuse them again."""
        return any(c.exited() == CONFIG_ERROR_EXIT for c in self.children)

    def exit_cause(self) -> str | None:
        """Why the part went, or None while every child runs. In an MoE group a rank's
        death takes the others down: a signal is the likelier first cause."""
        exited = [(c, code) for c in self.children
                  if (code := c.exited()) is not None and c not in self.left_out]
        if not exited:
            return None
        child, code = min(exited, key=lambda e: e[1] >= 0)
        cause = describe_exit(code)
        return cause if len(self.children) == 1 else f"{cause} ({child.name})"


class Supervision:
    """Restarts the parts of the cluster; `check` runs once per poll of serve's loop."""

    def __init__(self, parts: Sequence[Part], policy: RestartPolicy,
                 status_file: Path | None = None,
                 registry: CollectorRegistry | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.parts = list(parts)
        self.config_error = False
        """A part could not start for a reason no restart cures: serve exits 2."""
        self._clock = clock
        self._trackers = {p.name: RestartTracker(p.name, policy, clock) for p in self.parts}
        self._status_file = status_file
        self._restarts = None if registry is None else Counter(
            f"{PREFIX}serve_restarts", "Processes corestream serve restarted after they "
            "exited on their own (an MoE engine group counts once).", ["part"],
            registry=registry)
        for p in self.parts:
            if self._restarts is not None:
                self._restarts.labels(p.name)  # every series exists from the start, at 0
        self._write_status()

    @property
    def num_engines(self) -> int:
        """Engine processes not given up: the ones the cluster should have."""
        return sum(len(p.children) - len(p.left_out) for p in self.parts
                   if p.is_engine and not self._trackers[p.name].given_up)

    def start(self, part: Part) -> None:
        part.left_out.clear()
        for child in part.children:
            child.start()

    def check(self) -> str | None:
        """Notice exits and start the restarts that are due; why the cluster must stop,
        or None."""
        for part in self.parts:
            tracker = self._trackers[part.name]
            if tracker.given_up:
                continue
            if part.restart_at is None:
                cause = part.exit_cause()
                if cause is not None and (reason := self._on_exit(part, tracker, cause)):
                    return reason
            elif self._clock() >= part.restart_at:
                part.restart_at = None
                if part.replacing is not None:
                    for child in part.replacing:
                        child.start()
                    part.replacing = None
                    continue
                if part.before_restart is not None:
                    part.before_restart()
                self.start(part)
        return None

    def _on_exit(self, part: Part, tracker: RestartTracker, cause: str) -> str | None:
        if part.config_error():
            # Every engine has the same flags and checkpoint: one refusing them stops the
            # cluster, whether or not others still run.
            tracker.give_up(cause)
            self._write_status()
            self.config_error = True
            for child in part.children:
                child.stop(GROUP_STOP_S)
            return (f"{part.name} cannot start with these flags or this checkpoint (exit "
                    f"code {CONFIG_ERROR_EXIT}, its reason is above); no restart would cure it")
        refused = [c for c in part.children[1:]
                   if c.exited() == LEFT_OUT_EXIT and c not in part.left_out]
        if part.replaces_ranks and refused and part.children[0].exited() is None:
            # The group went on without it: another start would be refused the same way.
            part.left_out += refused
            log.error("%s: %s came back after the other ranks went on without it; left "
                      "out (restart the whole group to bring it back)", part.name,
                      ", ".join(c.name for c in refused))
            if part.exit_cause() is None:
                self._write_status()
                return None
        delay = tracker.on_exit(cause)
        exited = [c for c in part.children
                  if c.exited() is not None and c not in part.left_out]
        if part.replaces_ranks and part.children[0] not in exited and delay is None:
            # No replacement is coming: the other ranks go on without it, once their
            # engine_recovery_timeout_s has passed (if they can hold every expert).
            tracker.given_up = False  # the part serves on (its exits still count)
            part.left_out += exited
            log.error("%s: %s exited and is not replaced (%s); the other ranks go on "
                      "without it after --engine-recovery-timeout-s", part.name,
                      ", ".join(f"{c.name} ({describe_exit(c.exited() or 0)})"
                                for c in exited),
                      f"{tracker.recent_exits} exits within {tracker.policy.window_s:g} s"
                      if tracker.policy.max_restarts else "--max-restarts 0")
            self._write_status()
            return None
        if part.replaces_ranks and delay is not None and part.children[0] not in exited:
            part.replacing = exited
            log.error("%s: replacing %s alone; the other ranks re-form the group with it",
                      part.name, ", ".join(c.name for c in exited))
        else:
            # An MoE group is broken by any rank's exit: its other ranks go too.
            for child in part.children:
                child.stop(GROUP_STOP_S)
        if delay is not None:
            log.error("%s exited unexpectedly with %s; restart %d in %.1f s", part.name, cause,
                      tracker.restarts, delay)
            part.restart_at = self._clock() + delay
            if self._restarts is not None:
                self._restarts.labels(part.name).inc()
            self._write_status()
            return None
        self._write_status()
        crash_loop = (f"{tracker.recent_exits} exits within {tracker.policy.window_s:g} s"
                      if tracker.policy.max_restarts else "restarts are off (--max-restarts 0)")
        log.error("%s exited unexpectedly with %s; giving it up: %s", part.name, cause,
                  crash_loop)
        if part.essential:
            return f"{part.name} is gone ({crash_loop})"
        if not self.num_engines:
            return "no engine is left"
        log.error("serving on without %s, on %d engine(s)", part.name, self.num_engines)
        return None

    def _write_status(self) -> None:
        if self._status_file is None:
            return
        write_status(self._status_file, [
            PartStatus(t.part, t.restarts, t.last_exit, t.given_up)
            for t in self._trackers.values()])
