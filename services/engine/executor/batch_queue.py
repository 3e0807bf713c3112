"""BatchQueue: batches in flight on the execute thread, so the loop schedules ahead.

With `max_concurrent_batches` > 1 the executor runs on a thread of its own while
the loop schedules the next batch (pipeline parallelism). A request whose tokens
are in flight is not scheduled again until they come back (the scheduler's
bookkeeping); the oldest batch is collected when the queue is full or once it is
done. Until then the loop waits for input (a new request may make another batch)
or for the done batch's wakeup.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor

from services.common.thread_names import name_native_thread
from services.engine.executor.protocol import Executor
from services.engine.scheduler.output import RunnerOutput, SchedulerOutput

logger = logging.getLogger(__name__)


class BatchQueue:
    def __init__(self, executor: Executor, depth: int, wakeup: Callable[[], None]) -> None:
        """`wakeup()` unblocks the loop when a batch is done."""
        self._executor = executor
        self._depth = depth
        self._wakeup = wakeup
        self._batches: deque[tuple[Future[RunnerOutput], SchedulerOutput]] = deque()
        self._thread = ThreadPoolExecutor(1, thread_name_prefix="engine-execute",
                                          initializer=name_native_thread)

    def __len__(self) -> int:
        return len(self._batches)

    def step(self, schedule: Callable[[], SchedulerOutput | None],
             update: Callable[[SchedulerOutput, RunnerOutput], None]) -> bool:
        """Start the next batch from `schedule`, or `update` with the oldest one's
        outputs. True when the loop should block on input until the oldest is done."""
        batches = self._batches
        if len(batches) < self._depth:
            out = schedule()
            if out is not None:
                future = self._thread.submit(self._executor.execute, out)
                future.add_done_callback(lambda _: self._wakeup())
                batches.append((future, out))
                if len(batches) < self._depth:
                    return False  # back to the loop: take input, then try to start another
            elif not batches:
                time.sleep(0.001)  # work exists but none fits yet; do not spin hot
                return False
            elif not batches[0][0].done():
                return True
        future, out = batches.popleft()
        update(out, future.result())
        return False

    def close(self, name: str) -> None:
        """Let the batches in flight finish (their outputs are dropped) before the
        scheduler's requests are torn down, so no forward pass outlives the loop."""
        while self._batches:
            future, _ = self._batches.popleft()
            try:
                future.result()
            except Exception:
                logger.exception("%s: a batch in flight failed during shutdown", name)
        self._thread.shutdown(wait=False)
