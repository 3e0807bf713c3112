"""Small asyncio helpers shared by the services' background tasks."""

from __future__ import annotations

import asyncio
from typing import Any


async def cancel_and_wait(task: asyncio.Task[Any] | None) -> None:
    """Cancel `task` and wait until it has unwound (its finally blocks have run)."""
    if task is None:
        return
    task.cancel()
    try:
        await task
    except asyncio.CancelledError:
        # The task's own end, expected; but a cancel of the caller while it waited must
        # go on, or the caller would carry on as if nobody had cancelled it.
        current = asyncio.current_task()
        if current is not None and current.cancelling():
            raise
