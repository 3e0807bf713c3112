from __future__ import annotations

import asyncio
import subprocess
import sys
from pathlib import Path

import grpc
import pytest

from services.frontend.balancer import Balancer, EngineLoadInfo
from services.frontend.engine_client import EngineClient
from services.frontend.errors import RequestError


class _StubClient(EngineClient):
    """Connected at once, no network."""

    def start(self) -> None:
        self._connected = True
        self.closed = False

    async def close(self) -> None:
        self.closed = True
        self._connected = False


def test_picks_least_loaded_counting_local_in_flight() -> None:
    async def main() -> None:
        readiness: list[bool] = []
        balancer = Balancer("f", on_readiness=readiness.append, client_factory=_StubClient)
        await balancer.update([
            EngineLoadInfo("a:1", routable=True, alive=True, num_waiting=1, num_running=0),
            EngineLoadInfo("b:1", routable=True, alive=True, num_waiting=0, num_running=3),
            EngineLoadInfo("c:1", routable=False, alive=True),  # draining
        ])
        assert readiness == [True]
        assert balancer.pick().address == "b:1"  # 3 < 4 * 1
        # Two requests we sent to b that the snapshot does not show yet.
        balancer._clients["b:1"]._streams.update({"x": asyncio.Queue(), "y": asyncio.Queue()})
        assert balancer.pick().address == "a:1"
        # a vanishes (closed at once, nothing in flight); b vanishes but keeps its client.
        await balancer.update([EngineLoadInfo("c:1", routable=False, alive=True)])
        assert set(balancer._clients) == {"b:1", "c:1"}
        with pytest.raises(RequestError) as info:
            balancer.pick()
        assert info.value.code == grpc.StatusCode.UNAVAILABLE
        await balancer.close()
        assert readiness == [True, False]

    asyncio.run(main())


def test_frontend_never_imports_torch() -> None:
    code = (
        "import sys; import services.frontend.main, services.frontend.server; "
        "assert 'torch' not in sys.modules, 'torch was imported'"
    )
    root = Path(__file__).resolve().parents[3]
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60, cwd=root)
