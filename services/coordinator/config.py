"""Configuration of the DP coordinator."""

from __future__ import annotations

from dataclasses import dataclass

from services.common.config import doc


@dataclass(frozen=True)
class CoordinatorConfig:
    host: str = doc("Address to listen on.", default="127.0.0.1")
    port: int = doc("Port to listen on (0 = any free port).", default=50050)
    watch_min_interval_s: float = doc(
        "Least time between two load snapshots sent to a watcher.", default=0.1
    )
    watch_heartbeat_s: float = doc(
        "A watcher gets a snapshot at least this often, changed or not.", default=4.0
    )
    report_interval_s: float = doc(
        "How often engines report while their load is unchanged.", default=1.0
    )
    lease_timeout_s: float = doc(
        "An engine that sends no report for this long is dropped from the snapshots "
        "(a frozen or unreachable process); it is taken back when it registers again.",
        default=5.0,
    )
    log_level: str = doc("Log level (debug, info, warning, error).", default="info")

    def __post_init__(self) -> None:
        if not 0 <= self.port <= 65535:
            raise ValueError(f"port must be in [0, 65535], got {self.port}")
        if self.watch_min_interval_s < 0:
            raise ValueError(
                f"watch_min_interval_s must be >= 0, got {self.watch_min_interval_s}"
            )
        if self.watch_heartbeat_s <= 0:
            raise ValueError(f"watch_heartbeat_s must be > 0, got {self.watch_heartbeat_s}")
        if self.report_interval_s <= 0:
            raise ValueError(f"report_interval_s must be > 0, got {self.report_interval_s}")
        # One late heartbeat must not cost an engine its place.
        if not self.lease_timeout_s >= 2 * self.report_interval_s:
            raise ValueError(
                f"lease_timeout_s must be >= 2 * report_interval_s "
                f"({2 * self.report_interval_s:g}), got {self.lease_timeout_s}"
            )
