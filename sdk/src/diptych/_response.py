"""`with_raw_response`: a call's result together with the headers it came with (gRPC initial metadata of an
inference call, HTTP headers of an admin call), as openai-python's `LegacyAPIResponse` offers it.

The transports record the headers of a call's answer into the capture that the wrapper put in the current
context; the asyncio client's admin calls run in a worker thread, which `asyncio.to_thread` gives a copy of
the context, so the capture (a mutable object) is the wrapper's own there too.
"""

from __future__ import annotations

import functools
from collections.abc import Awaitable, Callable, Iterable, Mapping
from contextvars import ContextVar
from typing import Generic, ParamSpec, TypeVar

from ._ratelimits import rate_limit_status
from .types import RateLimitStatus

__all__ = ["APIResponse", "record_headers", "to_raw_response_wrapper", "async_to_raw_response_wrapper"]

P = ParamSpec("P")
R = TypeVar("R")


class _Capture:
    __slots__ = ("headers",)

    def __init__(self) -> None:
        self.headers: dict[str, str] = {}


_capture: ContextVar[_Capture | None] = ContextVar("diptych_raw_response", default=None)


def record_headers(headers: Iterable[tuple[str, object]] | None) -> None:
    """Keeps the answer's headers for a `with_raw_response` call running in this context (else does nothing)."""
    capture = _capture.get()
    if capture is not None:
        capture.headers = {str(name).lower(): str(value) for name, value in headers or ()}


class APIResponse(Generic[R]):
    """A call's answer: `headers` (names in lower case), the `request_id` and `rate_limits` they carry, and
    `parse()`, the result the call returns without `with_raw_response`."""

    def __init__(self, headers: Mapping[str, str], parsed: R) -> None:
        self.headers = dict(headers)
        self._parsed = parsed

    @property
    def request_id(self) -> str | None:
        return self.headers.get("x-request-id") or self.headers.get("request-id")

    @property
    def rate_limits(self) -> RateLimitStatus | None:
        return rate_limit_status(self.headers.items())

    def parse(self) -> R:
        return self._parsed

    def __repr__(self) -> str:
        return f"<APIResponse request_id={self.request_id!r} type={type(self._parsed).__name__}>"


# The wrappers copy no attribute of the method's function: its `__signature__` (set by
# resources/_keyword_parameters.py) names `self`, which the bound call has not. Without it,
# inspect.signature follows `__wrapped__` to the bound call.


def to_raw_response_wrapper(call: Callable[P, R]) -> Callable[P, APIResponse[R]]:
    @functools.wraps(call, updated=())
    def wrapped(*args: P.args, **kwargs: P.kwargs) -> APIResponse[R]:
        capture = _Capture()
        token = _capture.set(capture)
        try:
            parsed = call(*args, **kwargs)
        finally:
            _capture.reset(token)
        return APIResponse(capture.headers, parsed)

    return wrapped


def async_to_raw_response_wrapper(call: Callable[P, Awaitable[R]]) -> Callable[P, Awaitable[APIResponse[R]]]:
    @functools.wraps(call, updated=())
    async def wrapped(*args: P.args, **kwargs: P.kwargs) -> APIResponse[R]:
        capture = _Capture()
        token = _capture.set(capture)
        try:
            parsed = await call(*args, **kwargs)
        finally:
            _capture.reset(token)
        return APIResponse(capture.headers, parsed)

    return wrapped
