"""The headers of the Messages API: the API key as Anthropic's clients send it (`x-api-key`, or
`Authorization: Bearer`), and on every answer the request id (`request-id`, and `X-Request-Id` as the OpenAI
front names it) and the caller's rate-limit state under both names, OpenAI's and Anthropic's:

    x-ratelimit-limit-requests      anthropic-ratelimit-requests-limit
    x-ratelimit-remaining-requests  anthropic-ratelimit-requests-remaining
    x-ratelimit-reset-requests      anthropic-ratelimit-requests-reset
    (and the same for tokens)

Limits and remainders are the same numbers; a reset is a duration in OpenAI's header ("6m0s") and the time the
bucket is full again in Anthropic's (RFC 3339, in UTC, rounded up to the second).
"""

import math
import re
from datetime import UTC, datetime, timedelta

from aiohttp import web

from gateway.accounts.ratelimit_headers import Metadata
from gateway.types import ErrorKind, GatewayError

REQUEST_ID_HEADERS = ("request-id", "X-Request-Id")
_DURATION = re.compile(r"(?:(\d+)h)?(?:(\d+)m)?(?:(\d+(?:\.\d+)?)s)?")
_FAMILIES = ("requests", "tokens")
_FIELDS = ("limit", "remaining", "reset")


def authorization(request: web.Request) -> str | None:
    """The caller's key as the Authorization value the pipeline reads: `x-api-key` when sent, else the
    Authorization header. A key that is not printable ASCII cannot be an API key."""
    api_key = request.headers.get("x-api-key", "").strip()
    value = f"Bearer {api_key}" if api_key else request.headers.get("Authorization")
    if value is not None and not _printable_ascii(value):
        raise GatewayError(
            ErrorKind.UNAUTHENTICATED,
            "the API key holds characters that are not printable ASCII; send 'x-api-key: <api key>'",
        )
    if value is None:
        raise GatewayError(
            ErrorKind.UNAUTHENTICATED,
            "missing API key: send 'x-api-key: <api key>' or 'Authorization: Bearer <api key>'",
        )
    return value


def idempotency_key(request: web.Request) -> str | None:
    """The Idempotency-Key header (empty when none), or None when it is not printable ASCII."""
    value = request.headers.get("Idempotency-Key", "")
    return value if _printable_ascii(value) else None


def request_id_headers(request_id: str) -> dict[str, str]:
    return dict.fromkeys(REQUEST_ID_HEADERS, request_id)


def answer_headers(metadata: Metadata) -> dict[str, str]:
    """The pipeline's initial metadata of an admitted request (its execution, a replay, the rate limits)."""
    fields = dict(metadata)
    headers = request_id_headers(fields["request-id"])
    if fields.get("idempotent-replayed") == "true":
        headers["Idempotent-Replayed"] = "true"
    return headers | rate_limit_headers(metadata)


def rate_limit_headers(metadata: Metadata) -> dict[str, str]:
    """The x-ratelimit-* entries of `metadata`, and each under Anthropic's name."""
    headers = {name: value for name, value in metadata if name.startswith("x-ratelimit-")}
    for family in _FAMILIES:
        for field in _FIELDS:
            value = headers.get(f"x-ratelimit-{field}-{family}")
            if value is not None:
                headers[f"anthropic-ratelimit-{family}-{field}"] = reset_time(value) if field == "reset" else value
    return headers


def reset_time(duration: str, now: datetime | None = None) -> str:
    """When a bucket whose reset header says `duration` ("120ms", "1.5s", "6m0s") is full again."""
    full_at = (now or datetime.now(UTC)) + timedelta(milliseconds=duration_ms(duration))
    whole = full_at.replace(microsecond=0) + timedelta(seconds=math.ceil(full_at.microsecond / 1e6))
    return whole.strftime("%Y-%m-%dT%H:%M:%SZ")


def duration_ms(text: str) -> int:
    """The milliseconds of a duration as `ratelimit_headers.duration_text` writes it."""
    if text.endswith("ms") and text[:-2].isdigit():
        return int(text[:-2])
    found = _DURATION.fullmatch(text)
    if found is None or not text:
        raise ValueError(f"not a duration: {text!r}")
    hours, minutes, seconds = (float(part or 0) for part in found.groups())
    return round((hours * 3600 + minutes * 60 + seconds) * 1000)


def _printable_ascii(value: str) -> bool:
    return value.isascii() and value.isprintable()
