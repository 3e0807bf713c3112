"""Fixtures shared by the engine tests.

`server` serves the module's own `runner` fixture (a real tiny runner, or a fake one)
in process on 127.0.0.1:0; `channel` dials it. Every test module leaves the process's
CPU affinity as it found it: a tensor-parallel executor pins its process (rank 0) to
rank 0's share of the CPUs, which would otherwise follow into the modules after it.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import Any

import grpc
import pytest

from services.common.grpc_server import channel_options
from services.engine.config import EngineConfig
from services.engine.core.engine_core import EngineCore
from services.engine.server import EngineServer


@pytest.fixture(scope="module", autouse=True)
def _restore_cpu_affinity() -> Iterator[None]:
    cpus = os.sched_getaffinity(0)
    yield
    if os.sched_getaffinity(0) != cpus:
        os.sched_setaffinity(0, cpus)


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
