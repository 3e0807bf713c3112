"""The engine holds no memory per finished request: with the real tiny model, after a
warm-up, hundreds of requests of the same shapes leave the process's Python heap and
its resident memory where they were.

Requests of one shape on purpose: the libraries cache per shape (oneDNN keeps up to
1,024 primitives, one per linear layer and row count; buffers grow to the largest batch
seen), which the soak (benchmarks/soak) sees as growth that slows as shapes repeat.
With shapes fixed, whatever still grows grows per request, and 200 requests make even
a 10 KiB-per-request leak show above the allocator's noise.
"""

from __future__ import annotations

import gc
import os
import tracemalloc

import pytest

from services.engine.config import EngineConfig
from services.engine.core.engine_core import EngineCore
from services.engine.worker.config import RunnerConfig
from services.engine.worker.model_runner import ModelRunner as TorchModelRunner
from tests.unit.engine.fakes import collect, prompt_of, real_request

RSS_SLACK_BYTES = 2 << 20
PY_HEAP_SLACK_BYTES = 256 << 10


def rss_bytes() -> int:
    with open(f"/proc/{os.getpid()}/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


@pytest.mark.timeout(300)
def test_requests_of_one_shape_leave_memory_flat() -> None:
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
        # RSS first, without tracemalloc: its own bookkeeping is resident memory too.
        rss0 = rss_bytes()
        waves(25)
        gc.collect()
        rss1 = rss_bytes()
        tracemalloc.start()
        heap0 = tracemalloc.get_traced_memory()[0]
        waves(25)
        gc.collect()
        heap1 = tracemalloc.get_traced_memory()[0]
    finally:
        tracemalloc.stop()
        core.shutdown()
    print(f"\n200 requests: Python heap {heap1 - heap0:+d} B, RSS {rss1 - rss0:+d} B")
    assert heap1 - heap0 < PY_HEAP_SLACK_BYTES
    assert rss1 - rss0 < RSS_SLACK_BYTES
