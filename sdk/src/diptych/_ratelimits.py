"""Reading the gateway's `x-ratelimit-*` metadata (gRPC) or headers (HTTP) into a RateLimitStatus."""

from __future__ import annotations

import re
from collections.abc import Iterable

from .types import RateLimitStatus

__all__ = ["rate_limit_status"]

_DURATION = re.compile(r"(?:(\d+)h)?(?:(\d+)m(?!s))?(?:(\d+(?:\.\d+)?)s)?(?:(\d+)ms)?")


def rate_limit_status(metadata: Iterable[tuple[str, object]] | None) -> RateLimitStatus | None:
    """The status the metadata carries; None when it carries none. A value that does not parse is None."""
    values = {
        str(key).lower(): str(value) for key, value in metadata or () if str(key).lower().startswith("x-ratelimit-")
    }
    if not values:
        return None
    return RateLimitStatus(
        limit_requests=_integer(values.get("x-ratelimit-limit-requests")),
        remaining_requests=_integer(values.get("x-ratelimit-remaining-requests")),
        reset_requests=duration_seconds(values.get("x-ratelimit-reset-requests")),
        limit_tokens=_integer(values.get("x-ratelimit-limit-tokens")),
        remaining_tokens=_integer(values.get("x-ratelimit-remaining-tokens")),
        reset_tokens=duration_seconds(values.get("x-ratelimit-reset-tokens")),
    )


def duration_seconds(text: str | None) -> float | None:
    """Seconds in "1h2m3.5s", "6m0s", "1s" or "120ms"; None for anything else."""
    if not text:
        return None
    match = _DURATION.fullmatch(text)
    if match is None:
        return None
    hours, minutes, seconds, milliseconds = match.groups()
    return int(hours or 0) * 3600 + int(minutes or 0) * 60 + float(seconds or 0) + int(milliseconds or 0) / 1000


def _integer(text: str | None) -> int | None:
    return int(text) if text is not None and text.isdigit() else None
