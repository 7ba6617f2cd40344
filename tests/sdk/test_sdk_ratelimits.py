"""Reading the gateway's x-ratelimit-* metadata into RateLimitStatus (tests/e2e/test_ratelimit_headers_live.py
reads it off real calls)."""

import pytest

from diptych import RateLimitStatus
from diptych._ratelimits import duration_seconds, rate_limit_status


@pytest.mark.parametrize(
    ("text", "seconds"),
    [("0s", 0.0), ("120ms", 0.12), ("1s", 1.0), ("1.5s", 1.5), ("20.001s", 20.001), ("6m0s", 360.0),
     ("1m30.5s", 90.5), ("1h0m0s", 3600.0), ("2m", 120.0)],
)  # fmt: skip
def test_durations_as_the_gateway_writes_them(text, seconds):
    assert duration_seconds(text) == pytest.approx(seconds)


@pytest.mark.parametrize("text", [None, "", "soon", "1x", "-1s", "1s2m"])
def test_durations_that_do_not_parse_are_none(text):
    assert duration_seconds(text) is None


def test_metadata_becomes_a_status_and_a_missing_family_stays_none():
    metadata = (
        ("request-id", "req_1"),
        ("x-ratelimit-limit-requests", "3"),
        ("x-ratelimit-remaining-requests", "2"),
        ("X-RateLimit-Reset-Requests", "20s"),
    )
    assert rate_limit_status(metadata) == RateLimitStatus(limit_requests=3, remaining_requests=2, reset_requests=20.0)


def test_no_rate_limit_metadata_is_no_status():
    assert rate_limit_status((("request-id", "req_1"),)) is None
    assert rate_limit_status(None) is None
