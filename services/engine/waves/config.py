"""DataParallelConfig: how an engine joins the expert-parallel group of an MoE model.

Dense models ignore it: their data-parallel ranks are independent engines. An MoE
model's experts are split over the ranks, so the ranks form one process group
(rank 0 hosts its rendezvous) and step in lockstep waves (services/engine/waves/state.py).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from services.common.config import doc
from services.engine.waves.state import DEFAULT_CHECK_INTERVAL


@dataclass(frozen=True)
class DataParallelConfig:
    data_parallel_size: int = doc(
        "Ranks of the model's data-parallel group. For an MoE model they split the experts "
        "and step in lockstep waves; dense models ignore it.", default=1
    )
    data_parallel_master: str = doc(
        "HOST:PORT where rank 0 hosts the group's rendezvous (MoE with "
        "--data-parallel-size > 1).", default=""
    )
    wave_check_interval: int = doc(
        "Steps between the ranks' all-reduce of whether any still has work (the end of a "
        "wave is noticed within this many steps).", default=DEFAULT_CHECK_INTERVAL
    )
    prefill_schedule_interval: int = doc(
        "Steps between the steps in which a rank of an expert-parallel group admits new "
        "requests (starts prefills), counted from each wave's start, so that every rank "
        "prefills in the same steps and no rank's long prefill holds the others at the "
        "experts' collectives while they decode. 1: every step. Larger values make "
        "steps between admissions shorter and even across ranks, at the cost of up to "
        "N-1 steps of waiting before a new request's first token.", default=1
    )
    data_parallel_timeout: float = doc(
        "Seconds a rank waits for the others to join the group or a collective; past it "
        "the engine dies and its requests end with UNAVAILABLE (a lost rank never hangs "
        "the others).", default=60.0
    )

    def __post_init__(self) -> None:
        if not 1 <= self.data_parallel_size <= 1024:
            raise ValueError(
                f"data_parallel_size must be in [1, 1024], got {self.data_parallel_size}")
        if self.data_parallel_master:
            host, sep, port = self.data_parallel_master.rpartition(":")
            if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
                raise ValueError(f"data_parallel_master must be HOST:PORT, got "
                                 f"{self.data_parallel_master!r}")
        if self.wave_check_interval < 1:
            raise ValueError(
                f"wave_check_interval must be >= 1, got {self.wave_check_interval}")
        if not 1 <= self.prefill_schedule_interval <= 1024:
            raise ValueError(f"prefill_schedule_interval must be in [1, 1024], got "
                             f"{self.prefill_schedule_interval}")
        if not (0 < self.data_parallel_timeout < math.inf):
            raise ValueError(
                f"data_parallel_timeout must be > 0, got {self.data_parallel_timeout}")

    @property
    def master_host_port(self) -> tuple[str, int]:
        host, _, port = self.data_parallel_master.rpartition(":")
        return host.strip("[]"), int(port)  # the rendezvous store wants a bare IPv6 host
