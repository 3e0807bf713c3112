"""cancel_and_wait: waits for a task's unwinding without eating its caller's cancel."""

from __future__ import annotations

import asyncio

import pytest

from services.common.tasks import cancel_and_wait


async def _slow_to_unwind() -> None:
    try:
        await asyncio.sleep(10)
    finally:
        await asyncio.sleep(0.2)


def test_waits_until_the_task_has_unwound() -> None:
    async def main() -> None:
        task = asyncio.create_task(_slow_to_unwind())
        await asyncio.sleep(0)
        await cancel_and_wait(task)
        assert task.cancelled()
        await cancel_and_wait(None)

    asyncio.run(main())


def test_a_cancel_of_the_caller_is_not_swallowed() -> None:
    async def main() -> None:
        child = asyncio.create_task(_slow_to_unwind())
        await asyncio.sleep(0)

        async def closer() -> str:
            await cancel_and_wait(child)
            return "went on as if not cancelled"

        caller = asyncio.create_task(closer())
        await asyncio.sleep(0.05)  # the caller is waiting for the child to unwind
        caller.cancel()
        with pytest.raises(asyncio.CancelledError):
            await caller

    asyncio.run(main())
