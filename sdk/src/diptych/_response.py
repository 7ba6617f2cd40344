"""`with_raw_response`: a call's result together with the headers it came with (gRPC initial metadata of an
inference call, HTTP headers of an admin call), as openai-python's `LegacyAPIResponse` offers it; and
`with_streaming_response`: a context manager giving the HTTP response before its body is read
(`StreamedAPIResponse`: headers, status, `iter_bytes()` / `iter_lines()`, `parse()`), as openai-python's
`APIResponse` is given.

The transports record the headers of a call's answer into the capture that the wrapper put in the current
context; the asyncio client's admin calls run in a worker thread, which `asyncio.to_thread` gives a copy of
the context, so the capture (a mutable object) is the wrapper's own there too.
"""

from __future__ import annotations

import asyncio
import codecs
import functools
import json
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Iterator, Mapping
from contextvars import ContextVar
from http.client import HTTPResponse
from types import TracebackType
from typing import Any, Generic, ParamSpec, TypeVar, cast

from ._ratelimits import rate_limit_status
from .types import RateLimitStatus

__all__ = [
    "APIResponse",
    "AsyncResponseContextManager",
    "AsyncStreamedAPIResponse",
    "ResponseContextManager",
    "StreamedAPIResponse",
    "async_to_raw_response_wrapper",
    "async_to_streamed_response_wrapper",
    "record_headers",
    "to_raw_response_wrapper",
    "to_streamed_response_wrapper",
]

P = ParamSpec("P")
R = TypeVar("R")
T = TypeVar("T")
_CHUNK_BYTES = 64 * 1024


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

    def close(self) -> None:
        """Closes a streamed result (cancelling the call); a result read whole has nothing to close."""
        close = getattr(self._parsed, "close", None)
        if close is not None:
            close()

    def __repr__(self) -> str:
        return f"<APIResponse request_id={self.request_id!r} type={type(self._parsed).__name__}>"


_streaming: ContextVar[bool] = ContextVar("diptych_streaming_response", default=False)


def streaming_requested() -> bool:
    """Whether the HTTP call running in this context is to answer its response unread (`with_streaming_response`)."""
    return _streaming.get()


class StreamedAPIResponse(Generic[R]):
    """An HTTP call's answer before its body is read: `status_code`, `headers` (names in lower case), the
    `request_id` and `rate_limits` they carry; then the body, once, as bytes (`read()`, `iter_bytes()`), text
    (`text()`, `iter_text()`, `iter_lines()`), JSON (`json()`) or the call's usual result (`parse()`)."""

    def __init__(
        self, response: HTTPResponse, parse: Callable[[StreamedAPIResponse[Any]], R], *, method: str, url: str
    ) -> None:
        self.http_response = response
        self.status_code: int = response.status
        self.headers = {name.lower(): value for name, value in response.headers.items()}
        self.method = method
        self.url = url
        self._parse = parse
        self._content: bytes | None = None
        self._iterated = False
        self._parsed: list[R] = []  # the result, once parsed

    @property
    def request_id(self) -> str | None:
        return self.headers.get("x-request-id") or self.headers.get("request-id")

    @property
    def rate_limits(self) -> RateLimitStatus | None:
        return rate_limit_status(self.headers.items())

    @property
    def is_closed(self) -> bool:
        return self.http_response.isclosed()

    def parse(self) -> R:
        """The result the call gives without `with_streaming_response` (read from the body on the first call)."""
        if not self._parsed:
            self._parsed.append(self._parse(self))
        return self._parsed[0]

    def read(self) -> bytes:
        """The whole body (kept: `parse()`, `text()` and `json()` read it again from here)."""
        if self._content is None:
            if self._iterated:
                raise RuntimeError("The body was already read by iter_bytes(), iter_text() or iter_lines()")
            self._content = self.http_response.read()
        return self._content

    def text(self) -> str:
        return self.read().decode(self._charset())

    def json(self) -> object:
        return json.loads(self.read())

    def iter_bytes(self, chunk_size: int | None = None) -> Iterator[bytes]:
        """The body as it arrives, in pieces of at most `chunk_size` bytes."""
        size = chunk_size or _CHUNK_BYTES
        if self._content is not None:
            for start in range(0, len(self._content), size):
                yield self._content[start : start + size]
            return
        if self._iterated:
            raise RuntimeError("The body was already read by iter_bytes(), iter_text() or iter_lines()")
        self._iterated = True
        while piece := self.http_response.read1(size):
            yield piece

    def iter_text(self, chunk_size: int | None = None) -> Iterator[str]:
        decoder = codecs.getincrementaldecoder(self._charset())(errors="replace")
        for piece in self.iter_bytes(chunk_size):
            text = decoder.decode(piece)
            if text:
                yield text
        if tail := decoder.decode(b"", final=True):
            yield tail

    def iter_lines(self) -> Iterator[str]:
        """The body's lines as they arrive, without their line endings (server-sent events: one field a line)."""
        pending = ""
        for text in self.iter_text():
            lines = (pending + text).split("\n")
            pending = lines.pop()
            for line in lines:
                yield line.removesuffix("\r")
        if pending:
            yield pending.removesuffix("\r")

    def close(self) -> None:
        self.http_response.close()

    def mapped(self, convert: Callable[[R], T]) -> StreamedAPIResponse[T]:
        """This response, its `parse()` giving `convert` of what it gave."""
        parse = self._parse
        return StreamedAPIResponse(
            self.http_response, lambda response: convert(parse(response)), method=self.method, url=self.url
        )

    def _charset(self) -> str:
        return self.http_response.headers.get_content_charset() or "utf-8"

    def __repr__(self) -> str:
        return f"<StreamedAPIResponse [{self.status_code}] {self.method} {self.url}>"


def then(result: R, convert: Callable[[R], T]) -> T:
    """`convert` of a call's result; of its result to come when the call answered a `StreamedAPIResponse`
    (the asyncio resources wrap the sync ones' results this way)."""
    if isinstance(result, StreamedAPIResponse):
        return cast(T, result.mapped(convert))
    return convert(result)


class AsyncStreamedAPIResponse(Generic[R]):
    """`StreamedAPIResponse` of the asyncio client: the same attributes; reading the body is awaited
    (`await parse()`, `async for line in iter_lines()`), each read running in a worker thread."""

    def __init__(self, response: StreamedAPIResponse[R]) -> None:
        self._sync = response
        self.http_response = response.http_response
        self.status_code = response.status_code
        self.headers = response.headers
        self.method = response.method
        self.url = response.url

    @property
    def request_id(self) -> str | None:
        return self._sync.request_id

    @property
    def rate_limits(self) -> RateLimitStatus | None:
        return self._sync.rate_limits

    @property
    def is_closed(self) -> bool:
        return self._sync.is_closed

    async def parse(self) -> R:
        return await asyncio.to_thread(self._sync.parse)

    async def read(self) -> bytes:
        return await asyncio.to_thread(self._sync.read)

    async def text(self) -> str:
        return await asyncio.to_thread(self._sync.text)

    async def json(self) -> object:
        return await asyncio.to_thread(self._sync.json)

    async def iter_bytes(self, chunk_size: int | None = None) -> AsyncIterator[bytes]:
        async for piece in _in_thread(self._sync.iter_bytes(chunk_size)):
            yield piece

    async def iter_text(self, chunk_size: int | None = None) -> AsyncIterator[str]:
        async for text in _in_thread(self._sync.iter_text(chunk_size)):
            yield text

    async def iter_lines(self) -> AsyncIterator[str]:
        async for line in _in_thread(self._sync.iter_lines()):
            yield line

    async def close(self) -> None:
        await asyncio.to_thread(self._sync.close)

    def __repr__(self) -> str:
        return f"<AsyncStreamedAPIResponse [{self.status_code}] {self.method} {self.url}>"


async def _in_thread(items: Iterator[T]) -> AsyncIterator[T]:
    done = object()
    while (item := await asyncio.to_thread(next, items, done)) is not done:
        yield cast(T, item)


ClosableT = TypeVar("ClosableT", bound="StreamedAPIResponse[Any] | APIResponse[Any]")
AsyncClosableT = TypeVar("AsyncClosableT", bound="AsyncStreamedAPIResponse[Any] | AsyncAPIResponse[Any]")


class ResponseContextManager(Generic[ClosableT]):
    """Makes the call on entering the `with` block; closes its response on leaving it."""

    def __init__(self, request: Callable[[], ClosableT]) -> None:
        self._request = request
        self._response: ClosableT | None = None

    def __enter__(self) -> ClosableT:
        self._response = self._request()
        return self._response

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None, tb: TracebackType | None) -> None:
        if self._response is not None:
            self._response.close()


class AsyncResponseContextManager(Generic[AsyncClosableT]):
    """`ResponseContextManager` of the asyncio client: `async with`."""

    def __init__(self, request: Callable[[], Awaitable[AsyncClosableT]]) -> None:
        self._request = request
        self._response: AsyncClosableT | None = None

    async def __aenter__(self) -> AsyncClosableT:
        self._response = await self._request()
        return self._response

    async def __aexit__(
        self, kind: type[BaseException] | None, error: BaseException | None, tb: TracebackType | None
    ) -> None:
        if self._response is not None:
            await self._response.close()


class AsyncAPIResponse(APIResponse[R]):
    """`APIResponse` of an asyncio gRPC call given by `with_streaming_response`: closing it closes an `AsyncStream`."""

    async def close(self) -> None:  # type: ignore[override]
        close = getattr(self._parsed, "close", None)
        if close is not None:
            await close()


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


def to_streamed_response_wrapper(call: Callable[P, R]) -> Callable[P, ResponseContextManager[StreamedAPIResponse[R]]]:
    """`with_streaming_response` of an HTTP call: the call answers its response unread."""

    @functools.wraps(call, updated=())
    def wrapped(*args: P.args, **kwargs: P.kwargs) -> ResponseContextManager[StreamedAPIResponse[R]]:
        def request() -> StreamedAPIResponse[R]:
            token = _streaming.set(True)
            try:
                answer = call(*args, **kwargs)
            finally:
                _streaming.reset(token)
            assert isinstance(answer, StreamedAPIResponse), "an HTTP call answered without its transport"
            return answer

        return ResponseContextManager(request)

    return wrapped


def async_to_streamed_response_wrapper(
    call: Callable[P, Awaitable[R]],
) -> Callable[P, AsyncResponseContextManager[AsyncStreamedAPIResponse[R]]]:
    @functools.wraps(call, updated=())
    def wrapped(*args: P.args, **kwargs: P.kwargs) -> AsyncResponseContextManager[AsyncStreamedAPIResponse[R]]:
        async def request() -> AsyncStreamedAPIResponse[R]:
            token = _streaming.set(True)  # asyncio.to_thread hands a copy of the context to the worker thread
            try:
                answer = await call(*args, **kwargs)
            finally:
                _streaming.reset(token)
            assert isinstance(answer, StreamedAPIResponse), "an HTTP call answered without its transport"
            return AsyncStreamedAPIResponse(answer)

        return AsyncResponseContextManager(request)

    return wrapped


def to_streamed_grpc_response_wrapper(call: Callable[P, R]) -> Callable[P, ResponseContextManager[APIResponse[R]]]:
    """`with_streaming_response` of a gRPC call: its initial metadata as `headers` and `parse()`, the call's result
    (a `Stream` with `stream=True`, closed, and so cancelled, on leaving the `with` block). A gRPC answer is
    protobuf messages, not an HTTP body: there are no bytes or lines to iterate."""
    raw = to_raw_response_wrapper(call)

    @functools.wraps(call, updated=())
    def wrapped(*args: P.args, **kwargs: P.kwargs) -> ResponseContextManager[APIResponse[R]]:
        return ResponseContextManager(lambda: raw(*args, **kwargs))

    return wrapped


def async_to_streamed_grpc_response_wrapper(
    call: Callable[P, Awaitable[R]],
) -> Callable[P, AsyncResponseContextManager[AsyncAPIResponse[R]]]:
    @functools.wraps(call, updated=())
    def wrapped(*args: P.args, **kwargs: P.kwargs) -> AsyncResponseContextManager[AsyncAPIResponse[R]]:
        async def request() -> AsyncAPIResponse[R]:
            capture = _Capture()
            token = _capture.set(capture)
            try:
                parsed = await call(*args, **kwargs)
            finally:
                _capture.reset(token)
            return AsyncAPIResponse(capture.headers, parsed)

        return AsyncResponseContextManager(request)

    return wrapped
