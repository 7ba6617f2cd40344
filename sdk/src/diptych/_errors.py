"""The exceptions the SDK raises, and the mapping from gRPC failures to them."""

from __future__ import annotations

import grpc

__all__ = [
    "DiptychError",
    "APIConnectionError",
    "APITimeoutError",
    "APIResponseValidationError",
    "APIStatusError",
    "BadRequestError",
    "AuthenticationError",
    "PermissionDeniedError",
    "NotFoundError",
    "ConflictError",
    "RateLimitError",
    "ServiceUnavailableError",
    "InternalServerError",
    "error_from_rpc",
]


class DiptychError(Exception):
    """Base class of every error the SDK raises.

    `code` is the gRPC status name ("UNAVAILABLE", ...) or None when no gRPC status
    is involved; `request_id` identifies the logical request when there is one.
    """

    def __init__(self, message: str, *, code: str | None = None, request_id: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.code = code
        self.request_id = request_id

    def __str__(self) -> str:
        text = f"{self.code}: {self.message}" if self.code else self.message
        return f"{text} (request_id={self.request_id})" if self.request_id else text


class APIConnectionError(DiptychError):
    """The gateway could not be reached, or the connection broke before the call finished."""


class APITimeoutError(APIConnectionError):
    """The call ran past its deadline (the `timeout` option)."""


class APIResponseValidationError(DiptychError):
    """The gateway answered with something that does not follow the API contract."""


class APIStatusError(DiptychError):
    """The gateway ended the call with an error status.

    `retry_after` is the delay in seconds the gateway asked for in the `retry-after`
    trailing metadata, or None.
    """

    def __init__(
        self,
        message: str,
        *,
        code: str | None = None,
        request_id: str | None = None,
        retry_after: float | None = None,
    ) -> None:
        super().__init__(message, code=code, request_id=request_id)
        self.retry_after = retry_after


class BadRequestError(APIStatusError):
    pass


class AuthenticationError(APIStatusError):
    pass


class PermissionDeniedError(APIStatusError):
    pass


class NotFoundError(APIStatusError):
    pass


class ConflictError(APIStatusError):
    pass


class RateLimitError(APIStatusError):
    pass


class ServiceUnavailableError(APIStatusError):
    pass


class InternalServerError(APIStatusError):
    pass


_STATUS_ERRORS: dict[grpc.StatusCode, type[APIStatusError]] = {
    grpc.StatusCode.INVALID_ARGUMENT: BadRequestError,
    grpc.StatusCode.FAILED_PRECONDITION: BadRequestError,
    grpc.StatusCode.OUT_OF_RANGE: BadRequestError,
    grpc.StatusCode.UNAUTHENTICATED: AuthenticationError,
    grpc.StatusCode.PERMISSION_DENIED: PermissionDeniedError,
    grpc.StatusCode.NOT_FOUND: NotFoundError,
    grpc.StatusCode.ALREADY_EXISTS: ConflictError,
    grpc.StatusCode.ABORTED: ConflictError,
    grpc.StatusCode.RESOURCE_EXHAUSTED: RateLimitError,
    grpc.StatusCode.UNAVAILABLE: ServiceUnavailableError,
    grpc.StatusCode.INTERNAL: InternalServerError,
    grpc.StatusCode.UNKNOWN: InternalServerError,
    grpc.StatusCode.DATA_LOSS: InternalServerError,
    grpc.StatusCode.UNIMPLEMENTED: InternalServerError,
}

# grpcio gives no structured way to tell an UNAVAILABLE status synthesized by the
# client's own transport from one the gateway sent, so the transport's wording decides.
_TRANSPORT_FAILURE_PHRASES = (
    "failed to connect",
    "connection refused",
    "connection reset",
    "connections to all backends failing",
    "socket closed",
    "broken pipe",
    "endpoint closing",
    "dns resolution failed",
    "empty address list",
    "goaway",
    "keepalive",
    "ping timeout",
    "handshake",
)


def error_from_rpc(error: grpc.RpcError, *, request_id: str | None) -> DiptychError:
    """Maps a failed gRPC call (sync or asyncio) to the matching SDK exception."""
    status = _call_attribute(error, "code") or grpc.StatusCode.UNKNOWN
    details = _call_attribute(error, "details") or status.name
    code = status.name

    if status is grpc.StatusCode.DEADLINE_EXCEEDED:
        return APITimeoutError(details, code=code, request_id=request_id)
    if status is grpc.StatusCode.CANCELLED:
        return APIConnectionError(details, code=code, request_id=request_id)
    if status is grpc.StatusCode.UNAVAILABLE and _is_transport_failure(details):
        return APIConnectionError(details, code=code, request_id=request_id)

    error_class = _STATUS_ERRORS.get(status, InternalServerError)
    retry_after = _retry_after(_call_attribute(error, "trailing_metadata"))
    return error_class(details, code=code, request_id=request_id, retry_after=retry_after)


def _call_attribute(error: grpc.RpcError, name: str):
    # A bare grpc.RpcError (not a grpc.Call) carries no status; treat it as UNKNOWN.
    method = getattr(error, name, None)
    return method() if callable(method) else None


def _is_transport_failure(details: str) -> bool:
    lowered = details.lower()
    return any(phrase in lowered for phrase in _TRANSPORT_FAILURE_PHRASES)


def _retry_after(metadata) -> float | None:
    for key, value in metadata or ():
        if key.lower() == "retry-after":
            try:
                seconds = float(value)
            except (TypeError, ValueError):
                return None
            return seconds if seconds >= 0 else None
    return None
