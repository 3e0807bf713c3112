"""Request failures as gRPC statuses with google.rpc details.

Every failure the frontend reports is a `RequestError`; the servicer turns it into
a status with `to_status`. The plain message always stands on its own, the details
(BadRequest field violations, ErrorInfo reasons) are for programs.
"""

from __future__ import annotations

import grpc
from google.protobuf import any_pb2
from google.rpc import error_details_pb2, status_pb2
from grpc_status import rpc_status

ERROR_DOMAIN = "corestream.dev"


class RequestError(Exception):
    def __init__(
        self,
        code: grpc.StatusCode,
        message: str,
        field: str = "",
        reason: str = "",
    ) -> None:
        super().__init__(message)
        self.code = code
        self.message = message
        self.field = field
        """The request field at fault (a BadRequest field violation), if any."""
        self.reason = reason
        """An ErrorInfo reason in UPPER_SNAKE_CASE, if any."""


def invalid_argument(field: str, message: str, reason: str = "") -> RequestError:
    return RequestError(grpc.StatusCode.INVALID_ARGUMENT, message, field=field, reason=reason)


def unavailable(message: str) -> RequestError:
    return RequestError(grpc.StatusCode.UNAVAILABLE, message, reason="ENGINE_UNAVAILABLE")


def status_code_from_int(code: int) -> grpc.StatusCode:
    """A google.rpc.Code number (as engines send it) as a grpc.StatusCode."""
    for status_code in grpc.StatusCode:
        if status_code.value[0] == code:
            return status_code
    return grpc.StatusCode.INTERNAL


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
    # grpc.StatusCode numbers are the google.rpc.Code numbers.
    code = error.code.value[0]
    return rpc_status.to_status(
        status_pb2.Status(code=code, message=error.message, details=details)
    )


def _pack(message: error_details_pb2.BadRequest | error_details_pb2.ErrorInfo) -> any_pb2.Any:
    packed = any_pb2.Any()
    packed.Pack(message)
    return packed
