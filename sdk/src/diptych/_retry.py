"""Which failures are retried, how long to wait, and the retry loops themselves.

Retried: UNAVAILABLE (the gateway unreachable or without capacity),
RESOURCE_EXHAUSTED (rate limited), waiting what the server asks (`retry-after-ms`)
when it says, else exponential backoff with full jitter, and ABORTED (an earlier
try with the same idempotency key still runs, on the gateway or the admin API:
once it completed, the retry gets its stored result). Where retries are allowed at
all (`max_retries` > 0), ABORTED is waited out for up to EARLIER_TRY_PATIENCE_S however
many tries that takes: the earlier try may be on a gateway that died, whose key its
next run settles once it is back. Timeouts are not retried:
`timeout` is the caller's budget for a call, and a generation that ran out of it
would most likely run out again. A call is only retried until its first response
message arrives, so a retry never repeats output the caller has seen; every retry of
one create() call carries the same idempotency key, so it is billed once.
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from collections.abc import Awaitable, Callable
from typing import TypeVar

from ._errors import (
    APIConnectionError,
    APITimeoutError,
    ConflictError,
    DiptychError,
    RateLimitError,
    ServiceUnavailableError,
)

INITIAL_BACKOFF = 0.5
MAX_BACKOFF = 8.0
# A longer retry-after than this is handed to the caller rather than slept through.
MAX_RETRY_AFTER = 60.0
EARLIER_TRY_PATIENCE_S = 60.0

T = TypeVar("T")
log = logging.getLogger("diptych")


def backoff_delay(attempt: int, *, rng: Callable[[], float] = random.random) -> float:
    """Full-jitter delay before retry number `attempt + 1`: uniform in [0, min(8, 0.5 * 2**attempt))."""
    return rng() * min(MAX_BACKOFF, INITIAL_BACKOFF * 2.0**attempt)


def retry_delay(
    error: DiptychError, attempt: int, max_retries: int, waited_s: float = 0.0, earlier_try_seen: bool = False
) -> float | None:
    """Seconds to wait before retrying after `error` on try `attempt` (0-based), `waited_s` into the call,
    or None to give up. `earlier_try_seen`: an earlier try of this call met the key held by a try before
    it, whose gateway may have died; until that gateway's next run settles the key, reaching that gateway
    while it restarts (UNAVAILABLE) is part of the same wait."""
    waiting_out = _is_earlier_try_running(error) or (
        earlier_try_seen and _is_retryable(error) and not isinstance(error, RateLimitError)
    )
    if waiting_out and max_retries > 0:
        return backoff_delay(attempt) if waited_s < EARLIER_TRY_PATIENCE_S else None
    if attempt >= max_retries or not _is_retryable(error):
        return None
    retry_after = getattr(error, "retry_after", None)
    if retry_after is None:
        return backoff_delay(attempt)
    return retry_after if retry_after <= MAX_RETRY_AFTER else None


def resume_delay(error: DiptychError, attempt: int) -> float | None:
    """Seconds to wait before trying again to fetch a cut stream's answer, or None to give up: as long as
    the gateway is unreachable, or the key is still held (ABORTED) by the execution whose gateway stopped."""
    return backoff_delay(attempt) if _is_retryable(error) and not isinstance(error, RateLimitError) else None


def _is_retryable(error: DiptychError) -> bool:
    if isinstance(error, APITimeoutError):
        return False
    if isinstance(error, APIConnectionError):
        # Refused or reset before an answer; CANCELLED is never retried.
        return error.code in ("UNAVAILABLE", "connection_error")
    return _is_earlier_try_running(error) or isinstance(error, (ServiceUnavailableError, RateLimitError))


def _is_earlier_try_running(error: DiptychError) -> bool:
    """An earlier try with the same idempotency key still runs (gRPC ABORTED, or the admin API's 409); any
    other conflict does not go away by waiting."""
    return isinstance(error, ConflictError) and error.code in ("ABORTED", "idempotency_key_in_use")


def with_retries(attempt_call: Callable[[], T], *, max_retries: int) -> T:
    """Runs `attempt_call` until it returns, retrying the SDK errors that allow it."""
    attempt, started, earlier_try_seen = 0, time.monotonic(), False
    while True:
        try:
            return attempt_call()
        except DiptychError as error:
            delay = retry_delay(error, attempt, max_retries, time.monotonic() - started, earlier_try_seen)
            if delay is None:
                raise
            earlier_try_seen = earlier_try_seen or _is_earlier_try_running(error)
            _log_retry(error, delay, attempt)
        time.sleep(delay)
        attempt += 1


async def with_retries_async(attempt_call: Callable[[], Awaitable[T]], *, max_retries: int) -> T:
    """The asyncio twin of `with_retries`."""
    attempt, started, earlier_try_seen = 0, time.monotonic(), False
    while True:
        try:
            return await attempt_call()
        except DiptychError as error:
            delay = retry_delay(error, attempt, max_retries, time.monotonic() - started, earlier_try_seen)
            if delay is None:
                raise
            earlier_try_seen = earlier_try_seen or _is_earlier_try_running(error)
            _log_retry(error, delay, attempt)
        await asyncio.sleep(delay)
        attempt += 1


def _log_retry(error: DiptychError, delay: float, attempt: int) -> None:
    subject = error.idempotency_key or error.request_id or "(no id)"
    log.info("Retrying request %s in %.2f s (retry %d) after %s", subject, delay, attempt + 1, error.code)
