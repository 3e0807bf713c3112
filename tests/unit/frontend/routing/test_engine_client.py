"""EngineClient against the scripted engine: closing races the Session's own end; a
request id reused at once after an abort."""

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


@pytest.mark.timeout(30)
def test_a_request_id_reused_after_an_abort_gets_none_of_the_old_requests_outputs() -> None:
    """Abort "r" and send a new "r" at once (the frontend does, when a call fails and
    the client retries under its id): the engine answers the abort with the old
    request's ABORT output after the new request is in. That output, and any other of
    the old request's, must not end (or feed) the new one."""
    async def main() -> None:
        engine = FakeEngine(list(range(10, 30)), step_s=0.02)
        engine.answer_aborts = True
        server, address = await start_fake_engine(engine)
        client = EngineClient(address, "f")
        client.start()
        try:
            async with asyncio.timeout(10):
                while not client.accepting:
                    await asyncio.sleep(0.01)
            old = client.add(engine_pb2.AddRequest(request_id="r", prompt_token_ids=[1]))
            async with asyncio.timeout(10):
                first = await old.get()
            assert first.request_id == "r" and list(first.new_token_ids) == [10]
            assert client.abort("r")
            new = client.add(engine_pb2.AddRequest(request_id="r", prompt_token_ids=[1]))
            async with asyncio.timeout(10):
                await engine.aborted.wait()
                outputs = [await new.get()]
                while not outputs[-1].finish_reason:
                    outputs.append(await new.get())
            assert all(o.request_id == "r" for o in outputs)
            assert [t for o in outputs for t in o.new_token_ids] == list(range(10, 30))
            assert outputs[-1].finish_reason == common_pb2.FINISH_REASON_LENGTH
            assert old.empty() and client.num_in_flight == 0
            # The engine told the two apart: each attempt had an id of its own.
            assert len({add.request_id for add in engine.wire_adds}) == 2
            assert engine.wire_aborts == [engine.wire_adds[0].request_id]
        finally:
            await client.close()
            await server.stop(0)

    asyncio.run(main())
