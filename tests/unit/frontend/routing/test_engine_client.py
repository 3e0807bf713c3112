"""EngineClient against the scripted engine: closing races the Session's own end."""

from __future__ import annotations

import asyncio

import pytest
from corestream.common.v1 import common_pb2
from corestream.engine.v1 import engine_core_service_pb2 as engine_pb2

from services.frontend.routing.engine_client import EngineClient
from tests.unit.frontend.fakes import FakeEngine, start_fake_engine


@pytest.mark.timeout(30)
def test_close_while_the_engine_ends_the_session_returns() -> None:
    async def main() -> None:
        engine = FakeEngine([5, 6, 7], step_s=0.01)
        engine.final_state = common_pb2.ENGINE_STATE_STOPPED
        server, address = await start_fake_engine(engine)
        closing: list[asyncio.Task[None]] = []

        def on_change() -> None:
            # Called as the STOPPED state is read, just before the reader ends the
            # Session: close() is then scheduled ahead of the session's cleanup.
            if client._state == common_pb2.ENGINE_STATE_STOPPED and not closing:
                closing.append(asyncio.create_task(client.close()))

        client = EngineClient(address, "f", on_change)
        client.start()
        try:
            async with asyncio.timeout(10):
                while not client.accepting:
                    await asyncio.sleep(0.01)
            client.add(engine_pb2.AddRequest(request_id="r", prompt_token_ids=[1]))
            async with asyncio.timeout(10):
                while not closing:
                    await asyncio.sleep(0.01)
                await closing[0]  # hung forever when close()'s cancel was lost
            assert client._task is None and not client.connected
        finally:
            await server.stop(0)

    asyncio.run(main())
