from __future__ import annotations

import uuid

import grpc
import pytest

import diptych
from diptych._errors import error_from_http, error_from_rpc

EXPECTED = {
    grpc.StatusCode.CANCELLED: diptych.APIConnectionError,
    grpc.StatusCode.UNKNOWN: diptych.InternalServerError,
    grpc.StatusCode.INVALID_ARGUMENT: diptych.BadRequestError,
    grpc.StatusCode.DEADLINE_EXCEEDED: diptych.APITimeoutError,
    grpc.StatusCode.NOT_FOUND: diptych.NotFoundError,
    grpc.StatusCode.ALREADY_EXISTS: diptych.ConflictError,
    grpc.StatusCode.PERMISSION_DENIED: diptych.PermissionDeniedError,
    grpc.StatusCode.RESOURCE_EXHAUSTED: diptych.RateLimitError,
    grpc.StatusCode.FAILED_PRECONDITION: diptych.BadRequestError,
    grpc.StatusCode.ABORTED: diptych.ConflictError,
    grpc.StatusCode.OUT_OF_RANGE: diptych.BadRequestError,
    grpc.StatusCode.UNIMPLEMENTED: diptych.InternalServerError,
    grpc.StatusCode.INTERNAL: diptych.InternalServerError,
    grpc.StatusCode.UNAVAILABLE: diptych.ServiceUnavailableError,
    grpc.StatusCode.DATA_LOSS: diptych.InternalServerError,
    grpc.StatusCode.UNAUTHENTICATED: diptych.AuthenticationError,
}


class FailedCall(grpc.RpcError, grpc.Call):
    """The status part of a failed call, as grpcio's sync and aio errors expose it."""

    def __init__(self, code, details="", trailing_metadata=()):
        self._code, self._details, self._trailing_metadata = code, details, trailing_metadata

    def code(self):
        return self._code

    def details(self):
        return self._details

    def trailing_metadata(self):
        return self._trailing_metadata

    def initial_metadata(self):
        return ()

    def is_active(self):
        return False

    def time_remaining(self):
        return None

    def cancel(self):
        return False

    def add_callback(self, callback):
        return False


def test_every_status_code_is_mapped():
    assert set(EXPECTED) == set(grpc.StatusCode) - {grpc.StatusCode.OK}


def refuse(code: grpc.StatusCode, details: str, issued_id: str):
    """A server that refuses the call at once, naming it by an id that only the server knows."""

    def handler(request, context):
        context.set_trailing_metadata((("request-id", issued_id),))
        context.abort(code, details)
        yield  # a streaming handler

    return handler


@pytest.mark.parametrize("status", list(EXPECTED), ids=lambda status: status.name)
def test_a_refusal_from_the_server_reaches_the_caller_as_the_server_sent_it(server, status):
    """The server refused, not the SDK: the request reached it, and the error carries the server's status, its
    words and the id it issued, which the SDK had no other way to learn."""
    issued_id = f"req_{uuid.uuid4().hex}"
    server.servicer.script = [refuse(status, "the gateway says no", issued_id)]
    with (
        diptych.Client(api_key="sk-test", base_url=server.base_url, max_retries=0, timeout=5) as client,
        pytest.raises(diptych.DiptychError) as raised,
    ):
        client.completions.create(model="m", prompt="x", idempotency_key="order-7")
    error = raised.value
    assert type(error) is EXPECTED[status]
    assert (error.code, error.message, error.request_id) == (status.name, "the gateway says no", issued_id)
    assert str(error) == f"{status.name}: the gateway says no (request_id={issued_id})"
    (seen,) = server.servicer.requests
    assert (seen.model, seen.prompt, seen.idempotency_key) == ("m", "x", "order-7")
    assert error.idempotency_key == "order-7"


@pytest.mark.parametrize(
    "details",
    [
        "failed to connect to all addresses; last error: UNKNOWN: ipv4:127.0.0.1:1: Connection refused",
        "Socket closed",
        "DNS resolution failed for nowhere.invalid:50051",
        "keepalive watchdog timeout",
    ],
)
def test_unavailable_from_the_transport_is_a_connection_error(details):
    error = error_from_rpc(FailedCall(grpc.StatusCode.UNAVAILABLE, details), request_id=None)
    assert type(error) is diptych.APIConnectionError
    assert error.code == "UNAVAILABLE"


def test_timeout_is_a_connection_error():
    error = error_from_rpc(FailedCall(grpc.StatusCode.DEADLINE_EXCEEDED, "Deadline Exceeded"), request_id=None)
    assert isinstance(error, diptych.APIConnectionError)
    assert not isinstance(error, diptych.APIStatusError)


@pytest.mark.parametrize(
    ("trailers", "retry_after"),
    [
        ((("retry-after-ms", "2500"),), 2.5),
        ((("Retry-After-Ms", "3"),), 0.003),
        ((("other", "x"), ("retry-after-ms", "0")), 0.0),
        ((("retry-after-ms", "soon"),), None),
        ((("retry-after-ms", "-1"),), None),
        ((("retry-after-ms", "nan"),), None),
        ((("retry-after", "2"),), None),
        ((), None),
        (None, None),
    ],
)
def test_retry_after_is_parsed_from_trailing_metadata(trailers, retry_after):
    error = error_from_rpc(FailedCall(grpc.StatusCode.RESOURCE_EXHAUSTED, "slow down", trailers), request_id=None)
    assert isinstance(error, diptych.RateLimitError)
    assert error.retry_after == retry_after


def test_request_id_from_trailing_metadata_wins():
    trailers = (("request-id", "req_gateway"),)
    error = error_from_rpc(
        FailedCall(grpc.StatusCode.NOT_FOUND, "no such model", trailers), request_id="req_seen", idempotency_key="k1"
    )
    assert (error.request_id, error.idempotency_key) == ("req_gateway", "k1")
    assert error_from_rpc(FailedCall(grpc.StatusCode.NOT_FOUND, "x"), request_id="req_seen").request_id == "req_seen"


@pytest.mark.parametrize(
    ("status_code", "error_class"),
    [
        (400, diptych.BadRequestError),
        (401, diptych.AuthenticationError),
        (403, diptych.PermissionDeniedError),
        (404, diptych.NotFoundError),
        (409, diptych.ConflictError),
        (418, diptych.BadRequestError),
        (429, diptych.RateLimitError),
        (500, diptych.InternalServerError),
        (502, diptych.InternalServerError),
        (503, diptych.ServiceUnavailableError),
    ],
)
def test_error_from_http(status_code, error_class):
    body = {"error": {"type": "some_type", "message": "told so"}}
    error = error_from_http(status_code, body, {"Retry-After": "7"}, request_id="req_h")
    assert type(error) is error_class
    assert (error.message, error.code, error.status_code) == ("told so", "some_type", status_code)
    assert error.request_id == "req_h"
    assert error.retry_after == 7.0


def test_error_from_http_without_an_error_body():
    error = error_from_http(502, "<html>bad gateway</html>", {})
    assert (error.message, error.code, error.retry_after) == ("HTTP 502", "502", None)


def test_bare_rpc_error_is_internal():
    error = error_from_rpc(grpc.RpcError(), request_id="req_2")
    assert type(error) is diptych.InternalServerError
    assert error.code == "UNKNOWN"


def test_hierarchy():
    for status_error in set(EXPECTED.values()) - {diptych.APIConnectionError, diptych.APITimeoutError}:
        assert issubclass(status_error, diptych.APIStatusError)
    assert issubclass(diptych.APITimeoutError, diptych.APIConnectionError)
    assert not issubclass(diptych.APIConnectionError, diptych.APIStatusError)
    assert str(diptych.DiptychError("plain")) == "plain"
