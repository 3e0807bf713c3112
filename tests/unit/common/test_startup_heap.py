"""startup_heap.py: once frozen, what startup built is out of every later collection's
walk, and what requests make afterwards is still collected.

In a child process: gc.freeze is process-wide, and pytest's heap must stay as it is.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]

PROBE = textwrap.dedent("""
    import gc, json
    import grpc, torch  # a service's startup: the collector tracks ~100,000 objects
    from services.common.startup_heap import freeze_startup_objects

    before = len(gc.get_objects())
    frozen = freeze_startup_objects()
    after = len(gc.get_objects())

    # A request's garbage, made after the freeze: a cycle, found by a full collection.
    class Node:
        pass
    a, b = Node(), Node()
    a.peer, b.peer = b, a
    del a, b
    print(json.dumps({"before": before, "frozen": frozen, "after": after,
                      "collected": gc.collect()}))
""")


def test_startup_objects_leave_the_collections_walk_and_later_garbage_is_collected(
) -> None:
    done = subprocess.run([sys.executable, "-c", PROBE], cwd=ROOT, capture_output=True,
                          text=True, timeout=120, check=True)
    out = json.loads(done.stdout.strip().splitlines()[-1])
    assert out["before"] > 50_000, out
    assert out["frozen"] >= 0.9 * out["before"], out
    # What a full collection still walks: a few objects, not the startup's heap.
    assert out["after"] < 0.01 * out["before"], out
    assert out["collected"] >= 2, out
