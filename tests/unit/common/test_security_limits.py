"""Request limits, the overload status with its retry hint, and no pickle/eval on
any wire."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import grpc
import pytest
from corestream.common.v1 import common_pb2
from google.rpc import error_details_pb2
from grpc_status import rpc_status

from services.engine.config import EngineConfig
from services.frontend.config import FrontendConfig
from services.frontend.errors import (
    RETRY_AFTER_KEY,
    RequestError,
    engine_error,
    invalid_argument,
    to_status,
)
from services.frontend.generate.validation import RequestLimits, check_length, check_sampling

ROOT = Path(__file__).resolve().parents[3]
VOCAB = 1000


@pytest.mark.parametrize(("fields", "limits", "field", "message"), [
    ({"max_tokens": 65}, RequestLimits(max_tokens=64), "sampling.max_tokens",
     "must be <= 64 (this server's max_tokens_limit), got 65"),
    ({"n": 5}, RequestLimits(max_n=4), "sampling.n", "must be in [1, 4], got 5"),
    ({"stop": ["a", "b", "c"]}, RequestLimits(max_stop_strings=2), "sampling.stop",
     "has 3 strings, at most 2"),
    ({"stop": ["abcd"]}, RequestLimits(max_stop_string_chars=3), "sampling.stop",
     "sampling.stop[0] has 4 characters, at most 3"),
])
def test_limits(fields: dict[str, object], limits: RequestLimits, field: str,
                message: str) -> None:
    pb = common_pb2.SamplingParams(**fields)  # type: ignore[arg-type]
    with pytest.raises(RequestError) as info:
        check_sampling(pb, VOCAB, limits)
    assert info.value.code is grpc.StatusCode.INVALID_ARGUMENT
    assert info.value.field == field
    assert message in info.value.message
    # Within the limits the same fields pass.
    check_sampling(pb, VOCAB, RequestLimits(max_tokens=1000, max_n=16))


def test_max_tokens_limit_caps_the_default() -> None:
    assert check_length(10, None, 2048, max_tokens_limit=100) == 100
    assert check_length(2000, None, 2048, max_tokens_limit=100) == 48
    assert check_length(10, None, 2048) == 2038


def test_overload_status_carries_a_retry_hint() -> None:
    error = engine_error(8, "engine-core dp=0 is overloaded")
    status = to_status(error)
    assert status.code is grpc.StatusCode.RESOURCE_EXHAUSTED
    trailers = dict(status.trailing_metadata)
    assert trailers[RETRY_AFTER_KEY] == "1000"
    details = rpc_status.from_call(_FakeCall(status))  # the client's view of the trailers
    assert details is not None
    kinds = {}
    for detail in details.details:
        for cls in (error_details_pb2.RetryInfo, error_details_pb2.ErrorInfo):
            if detail.Is(cls.DESCRIPTOR):
                message = cls()
                detail.Unpack(message)
                kinds[cls.__name__] = message
    assert kinds["RetryInfo"].retry_delay.seconds == 1
    assert kinds["ErrorInfo"].reason == "OVERLOADED"
    # Other errors carry no retry hint.
    plain = to_status(invalid_argument("sampling.n", "bad n"))
    assert RETRY_AFTER_KEY not in dict(plain.trailing_metadata)
    assert engine_error(14, "gone").code is grpc.StatusCode.UNAVAILABLE
    assert engine_error(0, "").code is grpc.StatusCode.INTERNAL


class _FakeCall:
    """What rpc_status.from_call reads from a finished call."""

    def __init__(self, status: grpc.Status) -> None:
        self._status = status

    def code(self) -> grpc.StatusCode:
        return self._status.code  # type: ignore[no-any-return]

    def details(self) -> str:
        return self._status.details  # type: ignore[no-any-return]

    def trailing_metadata(self) -> tuple[tuple[str, object], ...]:
        return self._status.trailing_metadata  # type: ignore[no-any-return]


@pytest.mark.parametrize(("cls", "fields", "message"), [
    (FrontendConfig, {"max_message_bytes": 100}, "max_message_bytes"),
    (FrontendConfig, {"max_n": 0}, "max_n"),
    (FrontendConfig, {"max_concurrent_streams": 0}, "max_concurrent_streams"),
    (FrontendConfig, {"max_tokens_limit": -1}, "max_tokens_limit"),
    (FrontendConfig, {"max_stop_string_length": 0}, "max_stop_string_length"),
    (EngineConfig, {"max_waiting_requests": 0}, "max_waiting_requests"),
])
def test_limit_flags_are_validated(cls: type, fields: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        cls(**fields)


def test_safe_defaults() -> None:
    frontend = FrontendConfig()
    assert 0 < frontend.max_message_bytes <= 64 * 1024 * 1024
    assert frontend.max_n <= 64 and frontend.max_concurrent_streams <= 4096
    assert 0 < EngineConfig().max_waiting_requests <= 4096


# ---- nothing but protobuf on the wire -------------------------------------------

_BANNED_MODULES = {"pickle", "cPickle", "_pickle", "dill", "cloudpickle", "marshal", "shelve",
                   "joblib"}
_BANNED_CALLS = {"eval", "exec", "compile", "__import__"}


def _sources() -> list[Path]:
    return sorted(p for folder in ("services", "kernels") for p in (ROOT / folder).rglob("*.py"))


def _problems(path: Path) -> list[str]:
    found = []
    tree = ast.parse(path.read_text(encoding="utf-8"))
    for node in ast.walk(tree):
        where = f"{path}:{getattr(node, 'lineno', 0)}"
        if isinstance(node, ast.Import):
            found += [f"{where} imports {a.name}" for a in node.names
                      if a.name.split(".")[0] in _BANNED_MODULES]
        elif isinstance(node, ast.ImportFrom) and node.module:
            if node.module.split(".")[0] in _BANNED_MODULES:
                found.append(f"{where} imports from {node.module}")
        elif isinstance(node, ast.Call):
            func = node.func
            if isinstance(func, ast.Name) and func.id in _BANNED_CALLS:
                found.append(f"{where} calls {func.id}()")
            name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")
            if name == "load" and isinstance(func, ast.Attribute) and \
                    getattr(func.value, "id", "") == "torch":
                weights_only = [k for k in node.keywords if k.arg == "weights_only"]
                if not (weights_only and getattr(weights_only[0].value, "value", None) is True):
                    found.append(f"{where} calls torch.load without weights_only=True")
    return found


def test_no_pickle_or_eval_in_services_and_kernels() -> None:
    sources = _sources()
    assert len(sources) > 20
    problems = [p for path in sources for p in _problems(path)]
    assert not problems, "\n".join(problems)


def test_the_check_finds_what_it_bans(tmp_path: Path) -> None:
    bad = tmp_path / "bad.py"
    bad.write_text("import pickle\nfrom marshal import loads\nimport torch\n"
                   "eval('1')\ntorch.load('x')\ntorch.load('y', weights_only=True)\n")
    problems = _problems(bad)
    assert [re.sub(r"^.*:\d+ ", "", p) for p in problems] == [
        "imports pickle", "imports from marshal", "calls eval()",
        "calls torch.load without weights_only=True"]


# ---- per-connection stream cap ------------------------------------------------


@pytest.mark.timeout(60)
def test_max_concurrent_streams_caps_one_connection() -> None:
    """server_options' cap: with 2, a connection never has more than 2 calls running
    at the server. A client that already has the server's settings queues the others;
    calls it opened before that are refused (HTTP/2 REFUSED_STREAM, UNAVAILABLE to the
    client: never started, safe to retry). Which happens is a race, so both may."""
    import asyncio

    from services.common.grpc_server import server_options

    active = 0
    most = 0
    handled = 0

    async def slow(request: bytes, context: grpc.aio.ServicerContext) -> bytes:
        nonlocal active, most, handled
        active += 1
        handled += 1
        most = max(most, active)
        await asyncio.sleep(0.3)
        active -= 1
        return request

    async def scenario() -> list[bytes | BaseException]:
        server = grpc.aio.server(options=server_options(1 << 20, max_concurrent_streams=2))
        server.add_generic_rpc_handlers([grpc.method_handlers_generic_handler(
            "test.Slow", {"Call": grpc.unary_unary_rpc_method_handler(slow)})])
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
                call = channel.unary_unary("/test.Slow/Call")
                return list(await asyncio.gather(
                    *(call(bytes([i]), timeout=30) for i in range(6)), return_exceptions=True))
        finally:
            await server.stop(0)

    results = asyncio.run(scenario())
    ok = [r for r in results if isinstance(r, bytes)]
    refused = [r for r in results if isinstance(r, grpc.aio.AioRpcError)]
    assert len(ok) + len(refused) == 6
    assert all(r.code() is grpc.StatusCode.UNAVAILABLE for r in refused)
    assert most == 2 and len(ok) >= 2
    assert handled == len(ok)  # a refused call never reached the servicer
