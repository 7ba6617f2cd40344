"""Every answer of the control plane carries X-Request-Id (the caller's own when well formed, else a fresh
one), and every log line written while a request is served names it, through the handler that
settings.LOGGING configures."""

import io
import logging
import re

import pytest
from rest_framework.test import APIClient

from diptych_common.logs import RequestContextFilter

GENERATED = re.compile(r"req_[0-9A-Za-z]{20}")
INGEST_URL = "/api/v1/internal/usage-events"


@pytest.fixture
def control_plane_log():
    """What the control plane's configured stderr handler writes during the test."""
    handler = next(
        handler
        for handler in logging.getLogger().handlers
        if any(isinstance(each, RequestContextFilter) for each in handler.filters)
    )
    assert isinstance(handler, logging.StreamHandler)
    written = io.StringIO()
    earlier = handler.setStream(written)
    yield written
    handler.setStream(earlier)


def log_lines(written: io.StringIO, containing: str) -> list[str]:
    return [line for line in written.getvalue().splitlines() if containing in line]


def test_a_success_a_refusal_and_a_404_each_carry_their_own_request_id(client_a):
    answers = [
        client_a.get("/api/v1/organization"),
        APIClient().get("/api/v1/organization"),
        client_a.get("/api/v1/no-such-endpoint"),
    ]
    assert [answer.status_code for answer in answers] == [200, 401, 404]
    ids = [answer["X-Request-Id"] for answer in answers]
    assert all(GENERATED.fullmatch(request_id) for request_id in ids), ids
    assert len(set(ids)) == 3


@pytest.mark.parametrize(
    "sent", ["3f1c2a9e-8b7d-4c6e-9a1b-2d3e4f5a6b7c", "exec_0123abcd", "trace.42:span-7", "x" * 128]
)
def test_a_well_formed_request_id_of_the_callers_is_kept(client_a, sent):
    assert client_a.get("/api/v1/organization", HTTP_X_REQUEST_ID=sent)["X-Request-Id"] == sent


@pytest.mark.parametrize("sent", ["", "x" * 129, "two words", "a/b", "line\nbreak", "<script>", "café"])
def test_any_other_is_replaced_by_a_fresh_one(client_a, sent):
    assert GENERATED.fullmatch(client_a.get("/api/v1/organization", HTTP_X_REQUEST_ID=sent)["X-Request-Id"])


def test_log_lines_written_while_serving_a_request_name_it(control_plane_log, internal_client, key_a, make_usage_event):
    """The second batch repeats event exec-1 with other tokens: the control plane keeps the first and logs a
    warning while serving it. The line names the HTTP request; exec-1, the gateway's execution id in the
    event, is another id and stays in the message."""
    assert internal_client.post(INGEST_URL, {"events": [make_usage_event(key_a, "exec-1")]}).status_code == 200
    repeat = internal_client.post(INGEST_URL, {"events": [make_usage_event(key_a, "exec-1", tokens=121)]})
    assert repeat.status_code == 200
    [warning] = log_lines(control_plane_log, "differs from")
    assert warning.endswith(f" [request={repeat['X-Request-Id']}]")
    assert "request_id='exec-1'" in warning

    missing = internal_client.get("/api/v1/no-such-endpoint")  # Django logs it after the middleware has answered
    [not_found] = log_lines(control_plane_log, "Not Found: /api/v1/no-such-endpoint")
    assert not_found.endswith(f" [request={missing['X-Request-Id']}]")


def test_the_id_is_not_left_on_lines_written_after_the_request(control_plane_log, client_a):
    client_a.get("/api/v1/organization")
    logging.getLogger("controlplane.tests").warning("between requests")
    [line] = log_lines(control_plane_log, "between requests")
    assert "[request=" not in line
