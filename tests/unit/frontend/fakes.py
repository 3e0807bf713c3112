"""Shared fakes and helpers of the frontend tests.

- `FakeEngine`: a scripted EngineCoreService double, real gRPC, no model. Each added
  request emits the script's tokens one per step until max_tokens, an EOS id or a
  stop token id; the servicer records hellos, adds and aborts. Logprobs, when asked,
  are made up: token i of a request has logprob -i and rank i + 1, and its
  alternatives are the next ids. Requests run side by side on their own timers,
  unless `lockstep` makes them take turns token by token, as a batch does.
- The tiny byte-level BPE tokenizer and model of the `tokenizer` and `model_info`
  fixtures (conftest.py), and `serve_generate`: a FrontendServer in process against a
  FakeEngine, for GenerateService tests.
- The chat tests' tokenizer and model (`CHAT_*`), whose tool-call and reasoning
  markers are added tokens as in Qwen vocabularies.
- `StubClient`: an EngineClient connected at once, with no network.
- `chunkings`: ways to cut a text into streamed deltas, for the incremental parsers.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any

import grpc
from corestream.common.v1 import common_pb2
from corestream.engine.v1 import engine_core_service_pb2 as engine_pb2
from corestream.engine.v1 import engine_core_service_pb2_grpc as engine_pb2_grpc
from corestream.generate.v1 import generate_service_pb2_grpc as pb_grpc
from tokenizers import AddedToken, Tokenizer

from services.common.model_info import ModelInfo
from services.common.pooling import Pooler
from services.common.tiny_checkpoint import train_byte_level_bpe
from services.frontend.config import FrontendConfig
from services.frontend.main import event_loop_factory
from services.frontend.routing.engine_client import EngineClient
from services.frontend.server import FrontendServer
from services.frontend.tokenizer import TextTokenizer


def caller_id(wire_id: str) -> str:
    """The request id an EngineClient's caller gave, from the id the engine sees
    (the client adds "@<attempt>")."""
    return wire_id.rpartition("@")[0]


class FakeEngine(engine_pb2_grpc.EngineCoreServiceServicer):
    def __init__(self, script: list[int], step_s: float = 0.005, lockstep: int = 0) -> None:
        self.script = script
        self.step_s = step_s
        self.lockstep = lockstep
        """When set, no request sends its token i + 1 before this many requests have
        sent their token i: outputs interleave by construction, not by the timers (a
        sibling added after its first sample's first token, on a loaded machine, may
        otherwise start only after that sample is done)."""
        self._sent_per_position: dict[int, int] = {}
        self._turn = asyncio.Condition()
        self.hellos: list[engine_pb2.Hello] = []
        self.adds: list[engine_pb2.AddRequest] = []
        """What was added, under the caller's request ids (`wire_adds`: the engine's)."""
        self.aborts: list[str] = []
        """The caller's request ids aborted (`wire_aborts`: the engine's)."""
        self.wire_adds: list[engine_pb2.AddRequest] = []
        self.wire_aborts: list[str] = []
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
        self.answer_aborts = False
        """Answer an abort with the request's FINISH_REASON_ABORT output, as a real
        engine does."""

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
                    self.wire_adds.append(message.add)
                    add = engine_pb2.AddRequest()
                    add.CopyFrom(message.add)
                    add.request_id = caller_id(add.request_id)
                    self.adds.append(add)
                    if self.die_on_add:
                        out.put_nowait(None)
                        return
                    running[message.add.request_id] = asyncio.create_task(
                        self._generate(message.add, out)
                    )
                elif kind == "abort":
                    for request_id in message.abort.request_ids:
                        self.wire_aborts.append(request_id)
                        self.aborts.append(caller_id(request_id))
                        self.aborted.set()
                        task = running.pop(request_id, None)
                        if task is not None:
                            task.cancel()
                            if self.answer_aborts:
                                out.put_nowait(engine_pb2.SessionResponse(outputs=[
                                    engine_pb2.RequestOutput(
                                        request_id=request_id,
                                        finish_reason=common_pb2.FINISH_REASON_ABORT)]))

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
            if self.lockstep and i:
                async with self._turn:
                    await self._turn.wait_for(
                        lambda i=i: self._sent_per_position.get(i - 1, 0) >= self.lockstep)
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
            if self.lockstep:
                async with self._turn:
                    self._sent_per_position[i] = self._sent_per_position.get(i, 0) + 1
                    self._turn.notify_all()
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


# The tiny tokenizer and model of the `tokenizer` and `model_info` fixtures.
BOS_ID = 0
EOS_ID = 1
VOCAB_SIZE = 300
MAX_MODEL_LEN = 64

_CORPUS = [
    "hello world, the quick brown fox jumps over the lazy dog.",
    "a stream of tokens becomes a stream of text; stop here. STOP",
]


def build_tokenizer() -> Tokenizer:
    tokenizer = train_byte_level_bpe(_CORPUS * 10, VOCAB_SIZE, ("<s>", "</s>"))
    assert tokenizer.token_to_id("<s>") == BOS_ID and tokenizer.token_to_id("</s>") == EOS_ID
    return tokenizer


TEXT = "hello world, the quick brown fox"

GenerateBody = Callable[[pb_grpc.GenerateServiceStub, grpc.aio.Channel], Awaitable[None]]


def serve_generate(
    tokenizer: TextTokenizer,
    model_info: ModelInfo,
    engine: FakeEngine | None,
    body: GenerateBody,
    event_loop: str = "asyncio",
    pooler: Pooler | None = None,
    **config: Any,
) -> None:
    async def main() -> None:
        engine_server = None
        address = "127.0.0.1:1"  # nothing listens there
        if engine is not None:
            engine_server, address = await start_fake_engine(engine)
        frontend = FrontendServer(
            FrontendConfig(port=0, engines=(address,), **config), tokenizer, model_info,
            pooler=pooler,
        )
        port = await frontend.start()
        try:
            if engine is not None:
                async with asyncio.timeout(10):
                    while not frontend.balancer.ready:
                        await asyncio.sleep(0.01)
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
                await body(pb_grpc.GenerateServiceStub(channel), channel)
        finally:
            await frontend.stop(0)
            if engine_server is not None:
                await engine_server.stop(0)

    with asyncio.Runner(loop_factory=event_loop_factory(event_loop)) as runner:
        runner.run(main())


def script(tokenizer: TextTokenizer, text: str = TEXT, eos: bool = True) -> list[int]:
    return tokenizer.encode(text, add_special_tokens=False) + ([EOS_ID] if eos else [])


# The chat tests' tokenizer and model.
CHAT_SPECIAL = {"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>"}
CHAT_EOS_ID = 2
CALL_TEXT = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'


def _chat_tokenizer() -> TextTokenizer:
    lines = ["Weather in Paris is sunny; the city is nice.", 'get_weather {"city": "Paris"}',
             "Let me check. I think about it. Hello there!"] * 5
    backend: Tokenizer = train_byte_level_bpe(lines, 400, ("<unk>", "<s>", "</s>"))
    # As in Qwen vocabularies: the markers are added tokens, but not special ones.
    backend.add_tokens([AddedToken(t, special=False, normalized=False)
                        for t in ("<tool_call>", "</tool_call>", "<think>", "</think>")])
    assert backend.token_to_id("</s>") == CHAT_EOS_ID
    return TextTokenizer(backend)


CHAT_TOKENIZER = _chat_tokenizer()
CHAT_MODEL = ModelInfo(name="chat-test", path=str(Path("/nonexistent")),
                       architectures=("LlamaForCausalLM",), vocab_size=CHAT_TOKENIZER.vocab_size,
                       max_model_len=4096, eos_token_ids=(CHAT_EOS_ID,), bos_token_id=1,
                       dtype="float32")


class StubClient(EngineClient):
    """Connected at once, no network."""

    def start(self) -> None:
        self._connected = True
        self.closed = False

    async def close(self) -> None:
        self.closed = True
        self._connected = False


def random_chunks(text: str, rng: random.Random) -> list[str]:
    chunks: list[str] = []
    pos = 0
    while pos < len(text):
        size = rng.randint(1, 8)
        chunks.append(text[pos : pos + size])
        pos += size
    return chunks


def chunkings(text: str) -> Iterator[list[str]]:
    """The text whole, a character at a time, split at every point, and randomly."""
    yield [text]
    yield list(text)
    for cut in range(1, len(text)):
        yield [text[:cut], text[cut:]]
    rng = random.Random(20240611)
    for _ in range(20):
        yield random_chunks(text, rng)
