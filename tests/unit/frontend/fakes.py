"""A scripted EngineCoreService double: real gRPC, no model.

Each added request emits the script's tokens one per step until max_tokens, an
EOS id or a stop token id; the servicer records hellos, adds and aborts. Logprobs,
when asked, are made up: token i of a request has logprob -i and rank i + 1, and
its alternatives are the next ids.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

import grpc
from corestream.common.v1 import common_pb2
from corestream.engine.v1 import engine_core_service_pb2 as engine_pb2
from corestream.engine.v1 import engine_core_service_pb2_grpc as engine_pb2_grpc


class FakeEngine(engine_pb2_grpc.EngineCoreServiceServicer):
    def __init__(self, script: list[int], step_s: float = 0.005) -> None:
        self.script = script
        self.step_s = step_s
        self.hellos: list[engine_pb2.Hello] = []
        self.adds: list[engine_pb2.AddRequest] = []
        self.aborts: list[str] = []
        self.aborted = asyncio.Event()
        self.error: tuple[int, str] | None = None
        """(google.rpc code, message): fail every request with FINISH_REASON_ERROR."""
        self.final_state: int | None = None
        """An engine state sent (e.g. DEAD) after the first token instead of finishing;
        DEAD then ends the Session with UNAVAILABLE, as a real engine does."""
        self.frozen = False
        """Send nothing at all (a SIGSTOPped process), not even a new Session's state."""
        self.die_on_add = False
        """End the Session with UNAVAILABLE on the next add, before any output (a
        process killed just as a request arrived)."""

    async def Session(
        self,
        request_iterator: AsyncIterator[engine_pb2.SessionRequest],
        context: grpc.aio.ServicerContext,
    ) -> AsyncIterator[engine_pb2.SessionResponse]:
        out: asyncio.Queue[engine_pb2.SessionResponse | None] = asyncio.Queue()
        running: dict[str, asyncio.Task[None]] = {}

        async def read() -> None:
            async for message in request_iterator:
                kind = message.WhichOneof("kind")
                if kind == "hello":
                    self.hellos.append(message.hello)
                    if message.hello.kv_cache_events:
                        # As a real engine does: its (here always empty) prefix cache.
                        out.put_nowait(engine_pb2.SessionResponse(
                            engine_state=common_pb2.ENGINE_STATE_RUNNING,
                            kv_cache_snapshot=engine_pb2.KvCacheSnapshot(
                                epoch="fake", block_size=16)))
                elif kind == "add":
                    self.adds.append(message.add)
                    if self.die_on_add:
                        out.put_nowait(None)
                        return
                    running[message.add.request_id] = asyncio.create_task(
                        self._generate(message.add, out)
                    )
                elif kind == "abort":
                    for request_id in message.abort.request_ids:
                        self.aborts.append(request_id)
                        self.aborted.set()
                        task = running.pop(request_id, None)
                        if task is not None:
                            task.cancel()

        reader = asyncio.create_task(read())
        try:
            while self.frozen:
                await asyncio.sleep(0.05)
            yield engine_pb2.SessionResponse(engine_state=common_pb2.ENGINE_STATE_RUNNING)
            while (message := await out.get()) is not None:
                yield message
            await context.abort(grpc.StatusCode.UNAVAILABLE, "fake engine is dead (scripted)")
        finally:
            reader.cancel()
            for task in running.values():
                task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await reader

    async def _generate(
        self, add: engine_pb2.AddRequest, out: asyncio.Queue[engine_pb2.SessionResponse | None]
    ) -> None:
        max_tokens = add.sampling.max_tokens
        for i, token_id in enumerate(self.script):
            await asyncio.sleep(self.step_s)
            while self.frozen:
                await asyncio.sleep(0.05)
            output = engine_pb2.RequestOutput(
                request_id=add.request_id, new_token_ids=[token_id], num_cached_tokens=2
            )
            _add_logprobs(output, add, i)
            if self.final_state is not None:
                out.put_nowait(engine_pb2.SessionResponse(outputs=[output]))
                out.put_nowait(engine_pb2.SessionResponse(engine_state=self.final_state))
                if self.final_state == common_pb2.ENGINE_STATE_DEAD:
                    out.put_nowait(None)
                return
            if self.error is not None:
                output.finish_reason = common_pb2.FINISH_REASON_ERROR
                output.error_code, output.error_message = self.error
            elif token_id in add.eos_token_ids and not add.sampling.ignore_eos:
                # As a real engine: EOS where a constraint may end completes it.
                output.finish_reason = (
                    common_pb2.FINISH_REASON_STOP if add.sampling.WhichOneof("constraint")
                    else common_pb2.FINISH_REASON_EOS_TOKEN)
            elif token_id in add.sampling.stop_token_ids:
                output.finish_reason = common_pb2.FINISH_REASON_STOP_TOKEN
                output.stop_token_id = token_id
            elif i + 1 == max_tokens or i + 1 == len(self.script):
                output.finish_reason = common_pb2.FINISH_REASON_LENGTH
            # The message copies `output`, so it is built once the output is complete.
            out.put_nowait(
                engine_pb2.SessionResponse(
                    outputs=[output], engine_state=common_pb2.ENGINE_STATE_RUNNING
                )
            )
            if output.finish_reason:
                return


def fake_logprobs(token_id: int, i: int, num_top: int) -> common_pb2.PositionLogprobs:
    return common_pb2.PositionLogprobs(
        token_id=token_id, logprob=-float(i), rank=i + 1,
        top=[common_pb2.TopLogprob(token_id=token_id + k, logprob=-float(k))
             for k in range(1, num_top + 1)],
    )


def _add_logprobs(output: engine_pb2.RequestOutput, add: engine_pb2.AddRequest, i: int) -> None:
    sampling = add.sampling
    if sampling.HasField("logprobs"):
        output.new_logprobs.append(fake_logprobs(output.new_token_ids[0], i, sampling.logprobs))
    if sampling.HasField("prompt_logprobs") and i == 0:
        output.prompt_logprobs.extend(
            fake_logprobs(t, p, sampling.prompt_logprobs)
            for p, t in enumerate(add.prompt_token_ids[1:])
        )


async def start_fake_engine(engine: FakeEngine) -> tuple[grpc.aio.Server, str]:
    server = grpc.aio.server()
    engine_pb2_grpc.add_EngineCoreServiceServicer_to_server(engine, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    return server, f"127.0.0.1:{port}"
