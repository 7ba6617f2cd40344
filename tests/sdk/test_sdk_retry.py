from __future__ import annotations

import logging
import time

import pytest

import diptych
from diptych._retry import (
    EARLIER_TRY_PATIENCE_S,
    INITIAL_BACKOFF,
    MAX_BACKOFF,
    MAX_RETRY_AFTER,
    backoff_delay,
    retry_delay,
    with_retries,
)


@pytest.mark.parametrize("attempt", range(10))
def test_backoff_is_full_jitter_within_bounds(attempt):
    ceiling = min(MAX_BACKOFF, INITIAL_BACKOFF * 2**attempt)
    assert backoff_delay(attempt, rng=lambda: 0.0) == 0.0
    assert backoff_delay(attempt, rng=lambda: 0.999999) == pytest.approx(ceiling, rel=1e-5)
    assert all(0 <= backoff_delay(attempt) < ceiling for _ in range(200))


def test_backoff_schedule():
    ceilings = [backoff_delay(attempt, rng=lambda: 1.0) for attempt in range(7)]
    assert ceilings == [0.5, 1.0, 2.0, 4.0, 8.0, 8.0, 8.0]


def _status(error_class, **fields):
    return error_class("x", code="X", request_id="req_1", **fields)


@pytest.mark.parametrize(
    "error",
    [
        _status(diptych.ServiceUnavailableError),
        _status(diptych.RateLimitError),
        diptych.APIConnectionError("refused", code="UNAVAILABLE"),
        diptych.APIConnectionError("refused", code="connection_error"),
    ],
)
def test_transient_errors_are_retried_up_to_max_retries(error):
    assert 0 <= retry_delay(error, attempt=0, max_retries=2) <= INITIAL_BACKOFF
    assert 0 <= retry_delay(error, attempt=1, max_retries=2) <= 2 * INITIAL_BACKOFF
    assert retry_delay(error, attempt=2, max_retries=2) is None
    assert retry_delay(error, attempt=0, max_retries=0) is None


@pytest.mark.parametrize(
    "error",
    [
        diptych.ConflictError("idempotency key in use", code="ABORTED", request_id="req_1"),
        diptych.ConflictError("a request with this Idempotency-Key runs", code="idempotency_key_in_use"),
    ],
)
def test_an_earlier_try_still_running_is_waited_out_for_a_time_however_many_tries_it_takes(error):
    """The earlier try may be on a gateway that died: its key is settled once that gateway is back."""
    assert 0 <= retry_delay(error, attempt=0, max_retries=1) <= INITIAL_BACKOFF
    assert 0 <= retry_delay(error, attempt=5, max_retries=2, waited_s=30.0) <= MAX_BACKOFF
    assert retry_delay(error, attempt=5, max_retries=2, waited_s=EARLIER_TRY_PATIENCE_S) is None
    assert retry_delay(error, attempt=0, max_retries=0) is None  # no retries asked for: none


def test_a_gateway_restarting_while_an_earlier_try_holds_the_key_is_part_of_the_same_wait():
    """Try 1 met a gateway as it died (after it claimed the key), try 2 the key held by try 1's execution, try
    3 the dead gateway restarting: the call waits on until that gateway's next run settles the key, rather than
    failing for having spent its max_retries."""
    tries = iter(
        [
            diptych.APIConnectionError("reset", code="UNAVAILABLE"),
            diptych.ConflictError("a request with this idempotency key is still running", code="ABORTED"),
            diptych.APIConnectionError("failed to connect: connection refused", code="UNAVAILABLE"),
            diptych.APIConnectionError("failed to connect: connection refused", code="UNAVAILABLE"),
        ]
    )

    def attempt() -> str:
        error = next(tries, None)
        if error is not None:
            raise error
        return "the stored answer"

    assert with_retries(attempt, max_retries=2) == "the stored answer"
    refused = diptych.APIConnectionError("refused", code="UNAVAILABLE")
    assert retry_delay(refused, attempt=2, max_retries=2, earlier_try_seen=False) is None
    assert (
        retry_delay(refused, attempt=2, max_retries=2, waited_s=EARLIER_TRY_PATIENCE_S, earlier_try_seen=True) is None
    )


@pytest.mark.parametrize(
    "error",
    [
        _status(diptych.BadRequestError),
        _status(diptych.AuthenticationError),
        _status(diptych.PermissionDeniedError),
        _status(diptych.NotFoundError),
        _status(diptych.ConflictError),  # a REST conflict (code "X" here, "conflict" from the admin API)
        _status(diptych.InternalServerError),
        diptych.APITimeoutError("late", code="DEADLINE_EXCEEDED"),
        diptych.APIConnectionError("cancelled", code="CANCELLED"),
        diptych.APIConnectionError("reset after sending a POST", code="connection_lost"),
        diptych.APITimeoutError("admin API too slow", code="timeout"),
    ],
)
def test_other_errors_are_not_retried(error):
    assert retry_delay(error, attempt=0, max_retries=5) is None


def test_retry_after_is_honoured_and_bounded():
    assert retry_delay(_status(diptych.RateLimitError, retry_after=3.0), attempt=0, max_retries=2) == 3.0
    assert retry_delay(_status(diptych.ServiceUnavailableError, retry_after=0.0), attempt=1, max_retries=2) == 0.0
    too_long = _status(diptych.RateLimitError, retry_after=MAX_RETRY_AFTER + 1)
    assert retry_delay(too_long, attempt=0, max_retries=2) is None


def test_closed_port_raises_connection_error_after_retries(closed_port, caplog):
    caplog.set_level(logging.INFO, logger="diptych")
    started = time.monotonic()
    with (
        diptych.Client(api_key="k", base_url=f"127.0.0.1:{closed_port}", timeout=2.0, max_retries=1) as client,
        pytest.raises(diptych.APIConnectionError) as raised,
    ):
        client.completions.create(model="m", prompt="hi", idempotency_key="closed-1")
    assert time.monotonic() - started < 3.0
    assert type(raised.value) is diptych.APIConnectionError
    assert (raised.value.code, raised.value.idempotency_key, raised.value.request_id) == (
        "UNAVAILABLE",
        "closed-1",
        None,
    )
    assert [record.message.startswith("Retrying request closed-1") for record in caplog.records] == [True]


async def test_closed_port_raises_connection_error_after_retries_async(closed_port, caplog):
    caplog.set_level(logging.INFO, logger="diptych")
    started = time.monotonic()
    async with diptych.AsyncClient(api_key="k", base_url=f"grpc://127.0.0.1:{closed_port}", max_retries=1) as client:
        with pytest.raises(diptych.APIConnectionError) as raised:
            await client.with_options(timeout=2.0).models.list()
    assert time.monotonic() - started < 3.0
    assert type(raised.value) is diptych.APIConnectionError
    assert len(caplog.records) == 1
