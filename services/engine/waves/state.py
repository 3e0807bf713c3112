"""WaveState: when the ranks of an expert-parallel group step together.

Every MoE layer's collectives need every rank, so the ranks of one model run in
lockstep *waves*. A wave starts on a rank when it gets work while idle (it then
asks the coordinator to start the same wave on the others) or when the coordinator
relays another rank's start. While its wave runs a rank steps every iteration,
with a dummy batch when it has nothing of its own. Every `check_interval` steps the
ranks all-reduce whether any still has unfinished requests; when none has, all of
them end the wave at that same step, number the next one, and idle until work or a
start message arrives. With a `prefill_interval` N > 1 the ranks admit new requests
only in steps 0, N, 2N, ... of a wave, the same steps on every rank (the steps of a
wave are the same on every rank: each is one round of the experts' collectives).

Start messages race with endings: one for wave w can arrive after the ranks have
finished w (say a rank started it locally and finished it before the relay came
back). Such a message is stale and ignored; a rank only joins the wave it is
waiting for or a later one. Plain Python, no torch: the engine supplies the steps
and the all-reduce.
"""

from __future__ import annotations

from dataclasses import dataclass

DEFAULT_CHECK_INTERVAL = 32


@dataclass
class WaveState:
    check_interval: int = DEFAULT_CHECK_INTERVAL
    prefill_interval: int = 1
    wave: int = 0
    """The running wave, or the next one while idle."""
    running: bool = False
    steps: int = 0
    """Steps taken in the running wave."""
    num_dummy_steps: int = 0
    """Steps (over all waves) this rank ran without work of its own."""

    def __post_init__(self) -> None:
        if self.check_interval < 1:
            raise ValueError(f"check_interval must be >= 1, got {self.check_interval}")
        if self.prefill_interval < 1:
            raise ValueError(f"prefill_interval must be >= 1, got {self.prefill_interval}")

    @property
    def admits(self) -> bool:
        """Whether the step about to run may start new requests (prefills)."""
        return self.steps % self.prefill_interval == 0

    def start(self, wave: int) -> bool:
        """Join `wave`; True when that starts this rank running (False when it already
        runs a wave or `wave` has ended here: a stale start)."""
        if self.running or wave < self.wave:
            return False
        self.wave, self.running, self.steps = wave, True, 0
        return True

    def start_local(self) -> bool:
        """This rank has work while idle: start the wave it waits for. True when the
        other ranks must be told (a start message for `wave`)."""
        return self.start(self.wave)

    def stepped(self, dummy: bool) -> bool:
        """Count a step of the running wave; True when the ranks must now agree
        (all-reduce) whether any still has work."""
        if not self.running:
            raise RuntimeError("stepped outside a wave")
        self.steps += 1
        self.num_dummy_steps += dummy
        return self.steps % self.check_interval == 0

    def agreed(self, any_rank_has_work: bool) -> bool:
        """The all-reduce's answer; True when the wave ended here (and on every rank)."""
        if any_rank_has_work:
            return False
        self.running = False
        self.wave += 1
        self.steps = 0
        return True
