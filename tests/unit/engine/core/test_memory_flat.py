"""The engine holds no memory per finished request: with the real tiny model, after a
warm-up, hundreds of requests of the same shapes leave the process's Python heap, its C
heap and its resident memory where they were.

Requests of one shape on purpose: the libraries cache per shape (oneDNN keeps up to
1,024 primitives, one per linear layer and row count; buffers grow to the largest batch
seen), which the soak (benchmarks/soak) sees as growth that slows as shapes repeat.
With shapes fixed, whatever still grows grows per request, and 200 requests make even
a 10 KiB-per-request leak show above the allocator's noise.

In a child process of its own: resident memory is the whole process's, and in pytest's
it moved with whatever the tests before had left there. CI once saw +5.4 MiB for 200
requests with the Python heap flat, where alone it measures 0-40 KiB; the C heap was not
measured then. What the suite leaves matters: a malloc_trim(0) just before the
measurement (protobuf calls it in tests that run gRPC in process) gives +0.3-0.4 MiB, as
freed chunks whose pages went back to the kernel fault in again on reuse. The C heap in
use (mallinfo2) counts a leak whatever is resident, so that one is checked too.
"""

from __future__ import annotations

import ctypes
import gc
import json
import os
import subprocess
import sys
import tracemalloc
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[4]
RSS_SLACK_BYTES = 2 << 20
C_HEAP_SLACK_BYTES = 512 << 10
PY_HEAP_SLACK_BYTES = 256 << 10


def rss_bytes() -> int:
    with open(f"/proc/{os.getpid()}/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


class _Mallinfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in (
        "arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks",
        "fordblks", "keepcost")]


def c_heap_in_use() -> int | None:
    """Bytes malloc has handed out and not had back, over every arena and mmapped block
    (glibc's mallinfo2): what a leak of tensors or buffers grows, whatever is resident.
    None without glibc 2.33+."""
    libc = ctypes.CDLL(None)
    if not hasattr(libc, "mallinfo2"):
        return None
    libc.mallinfo2.restype = _Mallinfo2
    info = libc.mallinfo2()
    return info.uordblks + info.hblkhd


def measure() -> dict[str, int | None]:
    """200 requests after a warm-up of 160, in this process: the growth of each measure."""
    from services.engine.config import EngineConfig
    from services.engine.core.engine_core import EngineCore
    from services.engine.worker.config import RunnerConfig
    from services.engine.worker.model_runner import ModelRunner as TorchModelRunner
    from tests.unit.engine.fakes import collect, prompt_of, real_request

    # A KV cache the warm-up writes all of: its pages become resident as blocks are
    # first used, which is not a leak.
    runner = TorchModelRunner(RunnerConfig(kv_cache_memory="1MiB"))
    runner.warmup()
    assert runner.num_blocks * runner.block_size < 20 * 8 * 36
    vocab = runner.model_info.vocab_size
    core = EngineCore(EngineConfig(max_num_seqs=8), runner)
    q = core.sessions.open("s")
    core.start()
    sent = 0

    def waves(n: int) -> None:
        nonlocal sent
        for _ in range(n):
            batch = [real_request(f"r{sent + i}", prompt_of(20, sent + i, vocab), 16)
                     for i in range(8)]
            sent += len(batch)
            for r in batch:
                core.add_request(r)
            collect(q, {r.request_id for r in batch}, timeout=60)

    try:
        waves(20)
        gc.collect()
        # RSS and the C heap first, without tracemalloc: its own bookkeeping is both.
        rss0, c0 = rss_bytes(), c_heap_in_use()
        waves(25)
        gc.collect()
        rss1, c1 = rss_bytes(), c_heap_in_use()
        tracemalloc.start()
        heap0 = tracemalloc.get_traced_memory()[0]
        waves(25)
        gc.collect()
        heap1 = tracemalloc.get_traced_memory()[0]
    finally:
        tracemalloc.stop()
        core.shutdown()
    return {"rss": rss1 - rss0, "c_heap": None if c0 is None or c1 is None else c1 - c0,
            "py_heap": heap1 - heap0}


@pytest.mark.timeout(300)
def test_requests_of_one_shape_leave_memory_flat() -> None:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(
        [str(ROOT), str(ROOT / "protos"), str(ROOT / "kernels"), env.get("PYTHONPATH", "")])
    done = subprocess.run([sys.executable, "-m", "tests.unit.engine.core.test_memory_flat"],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=280)
    assert done.returncode == 0, done.stderr[-4000:]
    grew = json.loads(done.stdout.strip().splitlines()[-1])
    c_heap = "unmeasured" if grew["c_heap"] is None else f"{grew['c_heap']:+d} B"
    print(f"\n200 requests: Python heap {grew['py_heap']:+d} B, C heap {c_heap}, "
          f"RSS {grew['rss']:+d} B")
    assert grew["py_heap"] < PY_HEAP_SLACK_BYTES
    if grew["c_heap"] is not None:
        assert grew["c_heap"] < C_HEAP_SLACK_BYTES
    assert grew["rss"] < RSS_SLACK_BYTES


if __name__ == "__main__":
    print(json.dumps(measure()))
