"""Bearer-token client auth: a server interceptor for the asyncio servers.

Clients send `authorization: Bearer <key>` metadata. With API keys configured every
RPC needs one of them (or an admin key), except grpc.health.v1, which probes call
without credentials; server reflection needs a key too, since it tells a stranger
the whole API. With admin keys configured, the admin services (and the admin methods
of other services) need one of those; a valid API key there is PERMISSION_DENIED. A
presented key's SHA-256 is compared with hmac.compare_digest against every configured
key's, so the time taken tells neither how much of a guess matched, nor which key it
was close to, nor a key's length.
"""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path
from typing import Any

import grpc

HEALTH_SERVICE = "grpc.health.v1.Health"
AUTH_HEADER = "authorization"
_SCHEME = "bearer "


def load_keys(path: str, what: str = "api_key_file") -> tuple[bytes, ...]:
    """The keys in `path`: one per line; blank lines and # comments are ignored."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise ValueError(f"{what}: cannot read {path!r}: {exc}") from exc
    keys = tuple(
        line.encode() for raw in text.splitlines()
        if (line := raw.strip()) and not line.startswith("#"))
    if not keys:
        raise ValueError(f"{what}: {path!r} holds no key (one key per line)")
    for key in keys:
        if any(c.isspace() for c in key.decode()):
            raise ValueError(f"{what}: a key in {path!r} contains whitespace")
    return keys


def _digest(key: bytes) -> bytes:
    return hashlib.sha256(key).digest()


def _matches(candidate: bytes, digests: Sequence[bytes]) -> bool:
    # No early exit: every key is compared whatever the outcome.
    presented = _digest(candidate)
    found = False
    for digest in digests:
        found |= hmac.compare_digest(presented, digest)
    return found


def _bearer(metadata: Sequence[tuple[str, Any]] | None) -> bytes | None:
    for name, value in metadata or ():
        if name == AUTH_HEADER:
            text = value.decode("latin-1") if isinstance(value, bytes) else str(value)
            if text[:len(_SCHEME)].lower() == _SCHEME:
                return text[len(_SCHEME):].strip().encode("utf-8", "surrogateescape")
            return b""
    return None


def _service_of(method: str) -> str:
    # "/package.Service/Method"
    return method.lstrip("/").partition("/")[0]


def _denying_handler(
    handler: grpc.RpcMethodHandler, code: grpc.StatusCode, message: str
) -> grpc.RpcMethodHandler:
    """A handler of the same shape as `handler` that fails with `code` without reading
    the request (the request is not even parsed)."""

    async def unary(request: Any, context: grpc.aio.ServicerContext) -> Any:
        await context.abort(code, message)

    async def streaming(request: Any, context: grpc.aio.ServicerContext) -> Any:
        await context.abort(code, message)
        yield  # pragma: no cover  (makes this an async generator)

    def raw(data: bytes) -> bytes:
        return data

    behavior = streaming if handler.response_streaming else unary
    if handler.request_streaming and handler.response_streaming:
        return grpc.stream_stream_rpc_method_handler(behavior, raw)
    if handler.request_streaming:
        return grpc.stream_unary_rpc_method_handler(behavior, raw)
    if handler.response_streaming:
        return grpc.unary_stream_rpc_method_handler(behavior, raw)
    return grpc.unary_unary_rpc_method_handler(behavior, raw)


class BearerAuthInterceptor(grpc.aio.ServerInterceptor):
    def __init__(self, api_keys: Sequence[bytes], admin_keys: Sequence[bytes] = (),
                 admin_services: Sequence[str] = (), admin_methods: Sequence[str] = ()
                 ) -> None:
        """`admin_methods` are full method names ("/package.Service/Method")."""
        self._api_keys = tuple(map(_digest, api_keys))
        self._admin_keys = tuple(map(_digest, admin_keys))
        self._admin_services = frozenset(admin_services)
        self._admin_methods = frozenset(admin_methods)

    def check(self, method: str, metadata: Sequence[tuple[str, Any]] | None
              ) -> tuple[grpc.StatusCode, str] | None:
        """None when the call may proceed, else its status code and message."""
        service = _service_of(method)
        if service == HEALTH_SERVICE:
            return None
        admin = ((service in self._admin_services or method in self._admin_methods)
                 and bool(self._admin_keys))
        required = self._admin_keys if admin else self._api_keys + self._admin_keys
        if not required:
            return None
        token = _bearer(metadata)
        if token is None:
            return (grpc.StatusCode.UNAUTHENTICATED,
                    "missing credentials: send metadata 'authorization: Bearer <api key>'")
        if not token:
            return (grpc.StatusCode.UNAUTHENTICATED,
                    "the authorization metadata must be 'Bearer <api key>'")
        if _matches(token, required):
            return None
        if admin and _matches(token, self._api_keys):
            what = service if service in self._admin_services else method.lstrip("/")
            return (grpc.StatusCode.PERMISSION_DENIED,
                    f"{what} needs an admin key; this API key is not one")
        return grpc.StatusCode.UNAUTHENTICATED, "invalid API key"

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        denied = self.check(handler_call_details.method,
                            handler_call_details.invocation_metadata)
        handler = await continuation(handler_call_details)
        if denied is None or handler is None:
            return handler
        return _denying_handler(handler, *denied)


class _CallDetails(grpc.ClientCallDetails):
    def __init__(self, details: grpc.ClientCallDetails,
                 metadata: Sequence[tuple[str, str]]) -> None:
        self.method = details.method
        self.timeout = details.timeout
        self.credentials = details.credentials
        self.wait_for_ready = details.wait_for_ready
        self.compression = details.compression
        self.metadata = metadata


class _BearerClientInterceptor(grpc.UnaryUnaryClientInterceptor):
    def __init__(self, key: str) -> None:
        self._header = (AUTH_HEADER, f"Bearer {key}")

    def intercept_unary_unary(self, continuation: Any, client_call_details: Any,
                              request: Any) -> Any:
        metadata = [*(client_call_details.metadata or ()), self._header]
        return continuation(_CallDetails(client_call_details, metadata), request)


def with_api_key(channel: grpc.Channel, key_file: str) -> grpc.Channel:
    """`channel` sending the first key of `key_file` with every unary call (for
    command-line clients such as `corestream admin`)."""
    key = load_keys(key_file)[0].decode()
    return grpc.intercept_channel(channel, _BearerClientInterceptor(key))
