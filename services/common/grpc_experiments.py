"""The switches of gRPC's C core that corestream's processes set, and why.

The core reads GRPC_EXPERIMENTS once, when `grpc` is first imported; a value set after
that does nothing. So `apply()` runs where a process starts: the `corestream` command's
package (every service and `serve`'s children) and the test suite's conftest (so that
in-process tests run the client the services run).

`-event_engine_client`: gRPC 1.85's EventEngine client reads every message a stream
receives on a pool thread of its own, which hands it to the completion queue's poller
thread, which wakes the asyncio loop: about 6 thread wake-ups a message. The iomgr client
reads on the poller thread itself: about 2.3. A wake-up costs 30-70 us of CPU on a virtual
machine (a bare `time.sleep(0.005)` loop: 0.07-0.08 ms an iteration on the 2-core Zen 4
VM this was measured on), and a frontend receives one message a token from an engine, so
its single-stream CPU per token fell from 0.59-0.71 to 0.48-0.62 ms, context switches
from 10.1 to 6.3 (`benchmarks/cluster_cost.py --fixed-logits --step-ms 5`). Servers
keep the EventEngine listener: turning it off measured nothing.

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
