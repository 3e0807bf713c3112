"""Configuration of `corestream serve`, the one-machine launcher."""

from __future__ import annotations

from dataclasses import dataclass

from services.common.config import doc
from services.serve.restart_policy import INITIAL_BACKOFF_S

# Fields of the services' configs that `serve` sets per child process rather
# than passing through (the frontend's static `engines` list clashes with
# serve's engine count).
SERVE_OWNED = ("host", "port", "coordinator", "engine_index", "engines", "advertise_address",
               "health_host", "health_port", "metrics_port", "data_parallel_size",
               "data_parallel_master", "restart_status_file", "metrics_host")

METRICS_PORT = 9464
"""serve's default /metrics port (Prometheus exporters' customary 94xx range, outside the
ephemeral ports that processes get from the kernel)."""


@dataclass(frozen=True)
class ServeConfig:
    host: str = doc(
        "Address the public frontend listens on (its gRPC port, the HTTP door and its "
        "metrics); 0.0.0.0 for every interface, to be reached from other machines or "
        "containers. The internal ports (coordinator, engines) stay on 127.0.0.1.",
        default="127.0.0.1")
    port: int = doc("Port of the public frontend.", default=50051)
    engines: int = doc("Number of engine-core processes (data-parallel ranks).", default=1)
    coordinator_port: int = doc("Port of the coordinator (0 = any free port).", default=0)
    startup_timeout_s: float = doc(
        "Give up if the cluster is not serving within this many seconds.", default=300.0
    )
    stop_timeout_s: float = doc(
        "Time each process gets to exit after SIGTERM, beyond --shutdown-timeout (the "
        "drain), before it is killed.", default=15.0
    )

    max_restarts: int = doc(
        "Restarts of one process (an MoE engine group counts as one) allowed within "
        "--restart-window-s; one more exit is a crash loop and serve gives it up: it serves "
        "on without an engine, and stops the cluster for the coordinator or frontend. "
        "0 never restarts.", default=5
    )
    restart_window_s: float = doc(
        "The crash-loop window of --max-restarts, in seconds.", default=120.0
    )
    restart_backoff_max_s: float = doc(
        "Longest wait before a restart; the wait starts at 0.5 s and doubles with each "
        "exit within --restart-window-s.", default=30.0
    )

    metrics_port: int = doc(
        "Port of the one Prometheus /metrics endpoint of the whole cluster, on --host "
        "(0 = off): every process's metrics, read on each scrape from the private ports "
        "serve gives them, each sample labelled process=coordinator|frontend|engine-N|serve.",
        default=METRICS_PORT
    )

    tls_auto: bool = doc(
        "Generate a throwaway CA and a certificate per process (127.0.0.1, localhost) and "
        "run every process with mTLS; the files (ca.pem, client.pem, client.key for your "
        "own calls) go to --tls-dir.", default=False
    )
    tls_dir: str = doc(
        "Folder for the --tls-auto files; empty means a new folder under the system temp "
        "dir.", default=""
    )

    def __post_init__(self) -> None:
        if self.tls_dir and not self.tls_auto:
            raise ValueError("tls_dir is only used with --tls-auto")
        if not self.host:
            raise ValueError("host must be an address to listen on, e.g. 127.0.0.1 or 0.0.0.0")
        if not 0 <= self.port <= 65535:
            raise ValueError(f"port must be in [0, 65535], got {self.port}")
        if not 1 <= self.engines <= 64:
            raise ValueError(f"engines must be in [1, 64], got {self.engines}")
        if not 0 <= self.coordinator_port <= 65535:
            raise ValueError(f"coordinator_port must be in [0, 65535], got {self.coordinator_port}")
        if not 0 <= self.metrics_port <= 65535:
            raise ValueError(f"metrics_port must be in [0, 65535], got {self.metrics_port}")
        if self.max_restarts < 0:
            raise ValueError(f"max_restarts must be >= 0, got {self.max_restarts}")
        if self.restart_window_s <= 0:
            raise ValueError(f"restart_window_s must be > 0, got {self.restart_window_s}")
        if self.restart_backoff_max_s < INITIAL_BACKOFF_S:
            raise ValueError(f"restart_backoff_max_s must be >= {INITIAL_BACKOFF_S}, got "
                             f"{self.restart_backoff_max_s}")
        if self.startup_timeout_s <= 0:
            raise ValueError(f"startup_timeout_s must be > 0, got {self.startup_timeout_s}")
        if self.stop_timeout_s <= 0:
            raise ValueError(f"stop_timeout_s must be > 0, got {self.stop_timeout_s}")
