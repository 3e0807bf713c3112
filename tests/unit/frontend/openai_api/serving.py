"""A FrontendServer with its HTTP door (http_port=0) in front of a scripted engine, for
the HTTP door's tests: `serve(body)` runs `body(env)` against it."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import httpx
import openai

from services.common.observability import Observability
from services.common.tiny_checkpoint import TINY_CHAT_TEMPLATE
from services.frontend.chat.template import ChatTemplates
from services.frontend.config import FrontendConfig
from services.frontend.server import FrontendServer
from tests.unit.frontend.fakes import CHAT_EOS_ID as EOS_ID
from tests.unit.frontend.fakes import CHAT_MODEL as MODEL
from tests.unit.frontend.fakes import CHAT_SPECIAL as SPECIAL
from tests.unit.frontend.fakes import CHAT_TOKENIZER as TOKENIZER
from tests.unit.frontend.fakes import FakeEngine, start_fake_engine

ANSWER = "Weather in Paris is sunny; the city is nice."
KEY = "sk-test-key"


@dataclass
class Env:
    frontend: FrontendServer
    engine: FakeEngine
    base: str
    """http://127.0.0.1:<port>"""

    def client(self, api_key: str = KEY) -> openai.AsyncOpenAI:
        return openai.AsyncOpenAI(base_url=f"{self.base}/v1", api_key=api_key, max_retries=0,
                                  timeout=10)

    def http(self, **kwargs: Any) -> httpx.AsyncClient:
        kwargs.setdefault("timeout", 10)
        return httpx.AsyncClient(base_url=self.base, **kwargs)


Body = Callable[[Env], Awaitable[None]]


def script(text: str, eos: bool = True) -> list[int]:
    return TOKENIZER.encode(text, add_special_tokens=False) + ([EOS_ID] if eos else [])


def serve(body: Body, answer: str = ANSWER, *, eos: bool = True,
           engine: FakeEngine | None = None, engines: tuple[str, ...] | None = None,
           templates: ChatTemplates | None = None,
           observability: Observability | None = None, **config: Any) -> FakeEngine:
    engine = engine or FakeEngine(script(answer, eos), step_s=0.001)
    if templates is None:
        templates = ChatTemplates(default=TINY_CHAT_TEMPLATE, special_tokens=SPECIAL)

    async def main() -> None:
        engine_server, address = await start_fake_engine(engine)
        frontend = FrontendServer(
            FrontendConfig(port=0, http_port=0, engines=engines or (address,), **config),
            TOKENIZER, MODEL, chat_templates=templates, observability=observability)
        await frontend.start()
        try:
            if engines is None:
                async with asyncio.timeout(10):
                    while not frontend.balancer.ready:
                        await asyncio.sleep(0.01)
            async with asyncio.timeout(20):
                await body(Env(frontend, engine, f"http://127.0.0.1:{frontend.http_port}"))
        finally:
            await frontend.stop(0)
            await engine_server.stop(0)

    asyncio.run(main())
    return engine


def sse_events(raw: str) -> list[str]:
    """The data of each event, checking the framing: every event is one `data: ` line
    followed by a blank line."""
    assert raw.endswith("\n\n"), raw[-50:]
    events = raw[:-2].split("\n\n")
    for event in events:
        assert event.startswith("data: ") and "\n" not in event, event
    return [event.removeprefix("data: ") for event in events]
