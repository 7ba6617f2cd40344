"""The gateway's errors as Anthropic's error answers: `{"type": "error", "error": {"type", "message"},
"request_id"}` with the HTTP status Anthropic gives that type, so that its client raises the matching
exception (BadRequestError, AuthenticationError, NotFoundError, RateLimitError, ...)."""

import math
import uuid
from typing import Any

from aiohttp import web

from gateway.anthropic_api.headers import rate_limit_headers, request_id_headers
from gateway.types import ErrorKind, GatewayError, as_told

STATUS = {
    ErrorKind.INVALID_ARGUMENT: (400, "invalid_request_error"),
    ErrorKind.UNAUTHENTICATED: (401, "authentication_error"),
    ErrorKind.PERMISSION_DENIED: (403, "permission_error"),
    ErrorKind.NOT_FOUND: (404, "not_found_error"),
    ErrorKind.RESOURCE_EXHAUSTED: (429, "rate_limit_error"),
    ErrorKind.ABORTED: (409, "conflict_error"),
    ErrorKind.INTERNAL: (500, "api_error"),
    ErrorKind.UNAVAILABLE: (529, "overloaded_error"),
    ErrorKind.DEADLINE_EXCEEDED: (504, "timeout_error"),
}
REFUSAL_TYPES = {404: "not_found_error", 413: "request_too_large"}  # other refusals: invalid_request_error
# Anthropic's client raises EnforcedSpendLimitReachedError (a RateLimitError) on this code.
SPEND_LIMIT_CODE = "enforced_spend_limit_reached"


def new_answer_id() -> str:
    """The id of an answer no execution names (`req_` and 32 hex digits), as the OpenAI front gives one."""
    return f"req_{uuid.uuid4().hex}"


def error_body(kind: str, message: str, request_id: str, code: str | None = None) -> dict[str, Any]:
    error: dict[str, Any] = {"type": kind, "message": message}
    if code is not None:
        error["details"] = {"error_code": code}
    return {"type": "error", "error": error, "request_id": request_id}


def gateway_error_body(error: GatewayError, request_id: str) -> dict[str, Any]:
    _, kind = STATUS.get(error.kind, (500, "api_error"))
    spent = error.kind is ErrorKind.RESOURCE_EXHAUSTED and error.message.startswith("spend limit")
    return error_body(kind, error.message, request_id, SPEND_LIMIT_CODE if spent else None)


def refusal(status: int, message: str, request_id: str) -> web.Response:
    """A refusal at the door, before the caller is known (no rate-limit state to tell)."""
    kind = REFUSAL_TYPES.get(status, "api_error" if status >= 500 else "invalid_request_error")
    return web.json_response(
        error_body(kind, message, request_id), status=status, headers=request_id_headers(request_id)
    )


def error_response(error: GatewayError, request_id: str) -> web.Response:
    """`error` with its status, the caller's rate-limit state and, for a limit, when to retry."""
    status, _ = STATUS.get(error.kind, (500, "api_error"))
    headers = {**request_id_headers(request_id), **rate_limit_headers(error.rate_limit_metadata)}
    if error.retry_after_ms is not None:
        headers["retry-after"] = str(max(1, math.ceil(error.retry_after_ms / 1000)))
        headers["retry-after-ms"] = str(error.retry_after_ms)
    return web.json_response(gateway_error_body(error, request_id), status=status, headers=headers)


def execution_error(error: GatewayError, execution_id: str) -> web.Response:
    """The error that ended an execution, as its client is told it, named by the execution's id."""
    return error_response(as_told(error, execution_id), execution_id)
