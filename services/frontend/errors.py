"""Request failures as gRPC statuses with google.rpc details.

Every failure the frontend reports is a `RequestError`; the servicer turns it into
a status with `to_status`. The plain message always stands on its own, the details
(BadRequest field violations, ErrorInfo reasons, RetryInfo) are for programs.

An overloaded engine's refusal (RESOURCE_EXHAUSTED) carries a retry hint twice:
google.rpc.RetryInfo in the status details, and `retry-after-ms` trailing metadata
for clients that do not parse details.
"""

from __future__ import annotations

import collections
import math

import grpc
from google.protobuf import any_pb2, duration_pb2
from google.rpc import error_details_pb2, status_pb2
from grpc_status import rpc_status

ERROR_DOMAIN = "corestream.dev"
RETRY_AFTER_KEY = "retry-after-ms"
# What an overloaded engine's refusal asks clients to wait: about the time a
# waiting request needs to be admitted on a busy engine.
OVERLOAD_RETRY_AFTER_S = 1.0


class RequestError(Exception):
    def __init__(
        self,
        code: grpc.StatusCode,
        message: str,
        field: str = "",
        reason: str = "",
        retry_after_s: float | None = None,
    ) -> None:
        super().__init__(message)
        self.code = code
        self.message = message
        self.field = field
        """The request field at fault (a BadRequest field violation), if any."""
        self.reason = reason
        """An ErrorInfo reason in UPPER_SNAKE_CASE, if any."""
        self.retry_after_s = retry_after_s
        """How long the client should wait before retrying, if it should."""


def invalid_argument(field: str, message: str, reason: str = "") -> RequestError:
    return RequestError(grpc.StatusCode.INVALID_ARGUMENT, message, field=field, reason=reason)


def overloaded(message: str) -> RequestError:
    return RequestError(grpc.StatusCode.RESOURCE_EXHAUSTED, message, reason="OVERLOADED",
                        retry_after_s=OVERLOAD_RETRY_AFTER_S)


def unavailable(message: str) -> RequestError:
    return RequestError(grpc.StatusCode.UNAVAILABLE, message, reason="ENGINE_UNAVAILABLE")


def status_code_from_int(code: int) -> grpc.StatusCode:
    """A google.rpc.Code number (as engines send it) as a grpc.StatusCode."""
    for status_code in grpc.StatusCode:
        if status_code.value[0] == code:
            return status_code
    return grpc.StatusCode.INTERNAL


def engine_error(code: int, message: str) -> RequestError:
    """An engine's error output as a RequestError; an overload refusal gets a retry hint."""
    status_code = status_code_from_int(code) if code else grpc.StatusCode.INTERNAL
    message = message or "the engine failed the request"
    if status_code is grpc.StatusCode.RESOURCE_EXHAUSTED:
        return overloaded(message)
    return RequestError(status_code, message)


def to_status(error: RequestError) -> grpc.Status:
    details: list[any_pb2.Any] = []
    if error.field:
        bad_request = error_details_pb2.BadRequest(
            field_violations=[
                error_details_pb2.BadRequest.FieldViolation(
                    field=error.field, description=error.message
                )
            ]
        )
        details.append(_pack(bad_request))
    if error.reason:
        details.append(
            _pack(error_details_pb2.ErrorInfo(reason=error.reason, domain=ERROR_DOMAIN))
        )
    if error.retry_after_s is not None:
        delay = duration_pb2.Duration()
        delay.FromNanoseconds(int(error.retry_after_s * 1e9))
        details.append(_pack(error_details_pb2.RetryInfo(retry_delay=delay)))
    # grpc.StatusCode numbers are the google.rpc.Code numbers.
    code = error.code.value[0]
    status = rpc_status.to_status(
        status_pb2.Status(code=code, message=error.message, details=details)
    )
    if error.retry_after_s is None:
        return status
    retry_ms = str(math.ceil(error.retry_after_s * 1000))
    return _Status(status.code, status.details,
                   (*status.trailing_metadata, (RETRY_AFTER_KEY, retry_ms)))


class _Status(collections.namedtuple("_Status", ("code", "details", "trailing_metadata")),
              grpc.Status):
    pass


def _pack(
    message: error_details_pb2.BadRequest | error_details_pb2.ErrorInfo
    | error_details_pb2.RetryInfo,
) -> any_pb2.Any:
    packed = any_pb2.Any()
    packed.Pack(message)
    return packed
