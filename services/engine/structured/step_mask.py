"""Each step's token bitmask for its constrained rows, built beside the forward pass.

Right after `schedule()` the loop collects the grammars of the requests that will
sample this step and hands them to the mask thread; llguidance fills one packed
row per request (bit t of row r set = token t allowed), in parallel over its own
threads for large batches, without the GIL. The runner waits for the mask only
when its logits are ready, so the mask is built while the model runs. A step
without constrained rows builds nothing.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor

import llguidance
import numpy as np
from llguidance.numpy import allocate_token_bitmask, fill_next_token_bitmask

from services.common.thread_names import name_native_thread
from services.engine.scheduler.output import GrammarMask, SchedulerOutput
from services.engine.structured.grammar import Grammar

# Rows at or above this fill on llguidance's thread pool; below, one thread is faster.
PARALLEL_ROWS = 8


class StepMasks:
    def __init__(self, vocab_size: int, num_threads: int | None = None,
                 on_mask: Callable[[float, int], None] | None = None) -> None:
        self._vocab_size = vocab_size
        self._thread = ThreadPoolExecutor(1, thread_name_prefix="engine-mask",
                                          initializer=name_native_thread)
        self._executor: llguidance.LLExecutor | None = None
        self._num_threads = num_threads
        self._on_mask = on_mask

    def start(self, out: SchedulerOutput,
              grammar_of: Callable[[str], Grammar | None]) -> GrammarMask | None:
        """Begin the mask of `out`'s constrained sampled requests (None when none is).
        A request with draft tokens gets a row per position: the mask after each draft
        before it (the drafts are ones its grammar accepts)."""
        rows: list[str] = []
        grammars: list[tuple[Grammar, list[int]]] = []
        for sr in out.requests:
            if sr.sample and (grammar := grammar_of(sr.request_id)) is not None:
                k = sr.num_draft_tokens
                rows += [sr.request_id] * (k + 1)
                grammars.append((grammar, list(sr.token_ids[len(sr.token_ids) - k:])))
        if not rows:
            return None
        future: Future[np.ndarray] = self._thread.submit(self._fill, grammars, len(rows))
        return GrammarMask(tuple(rows), future)

    def close(self) -> None:
        self._thread.shutdown(wait=False, cancel_futures=True)

    def _fill(self, grammars: list[tuple[Grammar, list[int]]], num_rows: int) -> np.ndarray:
        start = time.perf_counter()
        bitmask = allocate_token_bitmask(num_rows, self._vocab_size)
        if num_rows == len(grammars) >= PARALLEL_ROWS:  # (no drafts: a row each)
            if self._executor is None:
                self._executor = llguidance.LLExecutor(self._num_threads)
            self._executor.unsafe_compute_mask_ptr(
                [(g.matcher, i) for i, (g, _) in enumerate(grammars)], bitmask.ctypes.data,
                bitmask.shape[1] * 4, num_rows)
        else:
            row = 0
            for g, drafts in grammars:
                fill_next_token_bitmask(g.matcher, bitmask, row)
                row += 1
                for token in drafts:
                    g.advance([token])
                    fill_next_token_bitmask(g.matcher, bitmask, row)
                    row += 1
                g.rollback(len(drafts))  # the update accepts what the step verifies
        if self._on_mask is not None:
            self._on_mask(time.perf_counter() - start, num_rows)
        return bitmask
