"""The switch of gRPC's C core that the frontend sets, and why the frontend only.

The core reads GRPC_EXPERIMENTS once, when `grpc` is first imported; a value set after
that does nothing. So `apply()` runs where the process starts: the `corestream` command's
package, when the command is `frontend` (serve's frontend child included).

`-event_engine_client`: gRPC 1.85's EventEngine client reads every message a stream
receives on a pool thread of its own, which hands it to the completion queue's poller
thread, which wakes the asyncio loop: about 5 thread wake-ups a message. The iomgr client
reads on the poller thread itself: about 2.2. A wake-up costs 30-70 us of CPU on a virtual
machine (a bare `time.sleep(0.005)` loop: 0.07-0.08 ms an iteration on the 2-core Zen 4
VM this was measured on), and a frontend receives one message a token from an engine, so
its single-stream CPU per token fell from 0.58-0.63 to 0.48-0.58 ms, its context switches
from 10.1 to 6.3 (`benchmarks/cluster_cost.py --fixed-logits --step-ms 5`).

Only the frontend: its channels are asyncio ones, whose poller thread polls all the time.
A synchronous channel on the iomgr client makes progress (a reconnect after its backoff,
say) only while some thread polls it, or when gRPC's backup poller comes round every 5 s:
with the switch on in every process, serve's health checks waited ~10 s for a coordinator
that had been listening for 9 (a test cluster's start went from 2.5 to 12.5 s). The engine
and the coordinator mostly serve, and a server keeps the EventEngine listener either way.

A GRPC_EXPERIMENTS the operator set is left as it is.
"""

from __future__ import annotations

import logging
import os
import sys

log = logging.getLogger(__name__)

EXPERIMENTS = "-event_engine_client"


def apply() -> None:
    """Sets GRPC_EXPERIMENTS unless it is set; call before anything imports `grpc`."""
    if "GRPC_EXPERIMENTS" in os.environ:
        return
    if "grpc" in sys.modules:
        log.warning("grpc was imported before corestream set GRPC_EXPERIMENTS=%s: "
                    "its streams use gRPC's defaults in this process", EXPERIMENTS)
    os.environ["GRPC_EXPERIMENTS"] = EXPERIMENTS
