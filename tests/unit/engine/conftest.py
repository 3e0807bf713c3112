"""Fixtures shared by the engine tests that talk to EngineCoreService over gRPC.

`server` serves the module's own `runner` fixture (a real tiny runner, or a fake one)
in process on 127.0.0.1:0; `channel` dials it.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import grpc
import pytest

from services.common.grpc_server import channel_options
from services.engine.config import EngineConfig
from services.engine.core.engine_core import EngineCore
from services.engine.server import EngineServer


@pytest.fixture
def server(runner: Any) -> Iterator[EngineServer]:
    core = EngineCore(EngineConfig(), runner)
    srv = EngineServer(core, runner, "127.0.0.1", 0)
    srv.start()
    core.start()
    yield srv
    core.shutdown()
    srv.stop(0.5)


@pytest.fixture
def channel(server: EngineServer) -> Iterator[grpc.Channel]:
    with grpc.insecure_channel(server.address, options=channel_options()) as ch:
        yield ch
