"""The exceptions the SDK raises, and the mapping from gRPC failures to them."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from email.message import Message
from typing import Any

import grpc

from ._ratelimits import rate_limit_status
from .types import RateLimitStatus

__all__ = [
    "APIConnectionError",
    "APIResponseValidationError",
    "APIStatusError",
    "APITimeoutError",
    "AuthenticationError",
    "BadRequestError",
    "ConflictError",
    "DiptychError",
    "InternalServerError",
    "NotFoundError",
    "PermissionDeniedError",
    "RateLimitError",
    "ServiceUnavailableError",
    "StreamInterruptedError",
    "error_from_http",
    "error_from_rpc",
]


class DiptychError(Exception):
    """Base class of every error the SDK raises.

    `code` is the gRPC status name ("UNAVAILABLE", ...) for inference calls, the error type
    of the REST API ("validation_error", ...) for admin calls, or None. `request_id` is the
    gateway's id of the request when it assigned one; `idempotency_key` is the key the
    failed create() call sent, so that the same logical request can be retried later.
    """

    def __init__(
        self,
        message: str,
        *,
        code: str | None = None,
        request_id: str | None = None,
        idempotency_key: str | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.code = code
        self.request_id = request_id
        self.idempotency_key = idempotency_key

    def __str__(self) -> str:
        text = f"{self.code}: {self.message}" if self.code else self.message
        return f"{text} (request_id={self.request_id})" if self.request_id else text


class APIConnectionError(DiptychError):
    """The gateway could not be reached, or the connection broke before the call finished."""


class StreamInterruptedError(APIConnectionError):
    """A stream was cut mid-way and what its request generated could not be fetched again: it was billed
    for what its gateway handed over. Retryable, under a new idempotency key: the request runs anew."""


class APITimeoutError(APIConnectionError):
    """The call ran past its deadline (the `timeout` option)."""


class APIResponseValidationError(DiptychError):
    """The gateway answered with something that does not follow the API contract."""


class APIStatusError(DiptychError):
    """The gateway (or the control plane, for admin calls) answered with an error status.

    `retry_after` is the delay in seconds the server asked for (gRPC trailing metadata
    `retry-after-ms`, HTTP header `Retry-After`), or None. `status_code` is the HTTP
    status of a failed admin call, None for inference calls. `rate_limits` is where the
    caller stands with its rate limits (the gateway's `x-ratelimit-*` metadata), or None.
    """

    def __init__(
        self,
        message: str,
        *,
        code: str | None = None,
        request_id: str | None = None,
        idempotency_key: str | None = None,
        retry_after: float | None = None,
        status_code: int | None = None,
        rate_limits: RateLimitStatus | None = None,
    ) -> None:
        super().__init__(message, code=code, request_id=request_id, idempotency_key=idempotency_key)
        self.retry_after = retry_after
        self.status_code = status_code
        self.rate_limits = rate_limits


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


def error_from_rpc(
    error: grpc.RpcError, *, request_id: str | None = None, idempotency_key: str | None = None
) -> DiptychError:
    """Maps a failed gRPC call (sync or asyncio) to the matching SDK exception.

    The gateway names its request in the trailing metadata `request-id`; that wins over
    `request_id`, the id known from the stream's messages.
    """
    status = _call_attribute(error, "code") or grpc.StatusCode.UNKNOWN
    details = _call_attribute(error, "details") or status.name
    trailers = _metadata_dict(_call_attribute(error, "trailing_metadata"))
    request_id = trailers.get("request-id") or request_id
    code = status.name

    if status is grpc.StatusCode.DEADLINE_EXCEEDED:
        return APITimeoutError(details, code=code, request_id=request_id, idempotency_key=idempotency_key)
    if status is grpc.StatusCode.CANCELLED or (
        status is grpc.StatusCode.UNAVAILABLE and _is_transport_failure(details)
    ):
        return APIConnectionError(details, code=code, request_id=request_id, idempotency_key=idempotency_key)

    error_class = _STATUS_ERRORS.get(status, InternalServerError)
    return error_class(
        details,
        code=code,
        retry_after=_retry_after_ms(trailers.get("retry-after-ms")),
        request_id=request_id,
        idempotency_key=idempotency_key,
        rate_limits=rate_limit_status(trailers.items()),
    )


def error_from_http(
    status_code: int, body: object, headers: Mapping[str, str] | Message, *, request_id: str | None = None
) -> APIStatusError:
    """Maps a failed REST call of the admin API (`{"error": {"type", "message"}}`) to an SDK exception."""
    error = body.get("error") if isinstance(body, dict) else None
    error = error if isinstance(error, dict) else {}
    message = str(error.get("message") or f"HTTP {status_code}")
    error_class = _HTTP_ERRORS.get(status_code) or (InternalServerError if status_code >= 500 else BadRequestError)
    return error_class(
        message,
        code=str(error.get("type") or status_code),
        request_id=request_id,
        retry_after=_retry_after_seconds(headers.get("Retry-After")),
        status_code=status_code,
    )


_HTTP_ERRORS: dict[int, type[APIStatusError]] = {
    400: BadRequestError,
    401: AuthenticationError,
    403: PermissionDeniedError,
    404: NotFoundError,
    409: ConflictError,
    410: NotFoundError,
    422: BadRequestError,
    429: RateLimitError,
    503: ServiceUnavailableError,
}


def _call_attribute(error: grpc.RpcError, name: str) -> Any:
    # A bare grpc.RpcError (not a grpc.Call) carries no status; treat it as UNKNOWN.
    method = getattr(error, name, None)
    return method() if callable(method) else None


def _metadata_dict(metadata: Iterable[tuple[str, str]] | None) -> dict[str, str]:
    return {str(key).lower(): value for key, value in metadata or ()}


def _is_transport_failure(details: str) -> bool:
    lowered = details.lower()
    return any(phrase in lowered for phrase in _TRANSPORT_FAILURE_PHRASES)


def _retry_after_ms(value: object) -> float | None:
    seconds = _non_negative_number(value)
    return None if seconds is None else seconds / 1000


def _retry_after_seconds(value: object) -> float | None:
    # An HTTP date in Retry-After is not supported: the control plane sends seconds.
    return _non_negative_number(value)


def _non_negative_number(value: object) -> float | None:
    try:
        number = float(value)  # type: ignore[arg-type]  # anything else is None below
    except (TypeError, ValueError):
        return None
    return number if number >= 0 and number != float("inf") else None
