"""What a service built at startup, out of the garbage collector's way.

A full (generation 2) collection walks every object the collector tracks, with the GIL
held: every thread of the process stops meanwhile. A warm engine tracks ~190,000 (torch,
gRPC, protobuf, the model's modules), and in process, 64 requests of 128 tokens at 32 in
flight on SmolLM2 Q8_0 ran one full collection that took 93 ms (2 cores, AMD EPYC): every
stream of the engine stalled that long, against a 40 ms step. What startup made lives as
long as the process, so once a service is ready it goes to the permanent generation
(gc.freeze): later collections walk only what requests have made since. The same run
after the freeze: no full collection, the longest pause 0.75 ms (a generation 1 one).
"""

from __future__ import annotations

import gc
import logging

logger = logging.getLogger(__name__)


def freeze_startup_objects() -> int:
    """Collect once, then move every object tracked now to the permanent generation.
    Returns how many are frozen (all of them, with earlier freezes)."""
    gc.collect()
    gc.freeze()
    frozen = gc.get_freeze_count()
    logger.info("%d startup objects frozen out of garbage collection", frozen)
    return frozen
