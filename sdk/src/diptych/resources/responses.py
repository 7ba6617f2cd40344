"""The Responses API: `client.responses` (create, stream, retrieve, delete, cancel, input_items), over the
gateway's HTTP API (`http_url`, OpenAI's shapes). A response is stored by default; one that continues it
(`previous_response_id`) runs on its conversation's token ids, so the prefix cache holds most of its prompt.

The asyncio twins run each call in a worker thread.
"""

from __future__ import annotations

import asyncio
import dataclasses
import uuid
from collections.abc import AsyncIterator, Callable, Iterable, Iterator, Mapping
from functools import cached_property, partial
from types import TracebackType
from typing import Any, Literal, Self, TypeVar, Unpack, cast

from .._errors import APIResponseValidationError
from .._gateway_http import events, json_object
from .._response import (
    StreamedAPIResponse,
    async_to_raw_response_wrapper,
    async_to_streamed_response_wrapper,
    then,
    to_raw_response_wrapper,
    to_streamed_response_wrapper,
)
from .._responses_convert import event_from_json, input_items_page_from_json, response_from_json
from ..types import (
    AsyncCursorPage,
    CursorPage,
    PostRequestOptions,
    RequestOptions,
    Response,
    ResponseCreateParams,
    ResponseEvent,
    ResponseInputItem,
)
from ._connections import GatewayHttpConnection
from ._keyword_parameters import KeywordParameters
from ._paths import segment

__all__ = ["AsyncResponseStream", "AsyncResponses", "ResponseStream", "Responses"]

T = TypeVar("T")

_CREATE_PARAMETERS = KeywordParameters(ResponseCreateParams)
_OPTIONS = KeywordParameters(RequestOptions)
_CALL_OPTIONS = ("timeout", "idempotency_key", "extra_headers", "extra_query", "extra_body")
_ENDINGS = ("response.completed", "response.incomplete", "response.failed")


class ResponseStream:
    """The events of a streamed response, in order; a context manager that closes the connection."""

    def __init__(self, events: Iterator[dict[str, object]]) -> None:
        self._events = events
        self._final: Response | None = None

    def __iter__(self) -> Iterator[ResponseEvent]:
        for body in self._events:
            event = event_from_json(body)
            if event.type in _ENDINGS:
                self._final = event.response
            yield event

    def get_final_response(self) -> Response:
        """Reads the rest of the stream; the response as its last event (completed, incomplete, failed) holds it."""
        for _ in self:
            pass
        if self._final is None:
            raise APIResponseValidationError("The stream ended without a response.completed, .incomplete or .failed")
        return self._final

    def close(self) -> None:
        close = getattr(self._events, "close", None)
        if close is not None:
            close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None, tb: TracebackType | None) -> None:
        self.close()


class AsyncResponseStream:
    """The asyncio twin of `ResponseStream`: `async for` the events; `async with` closes the connection."""

    def __init__(self, stream: ResponseStream) -> None:
        self._stream = stream
        self._events = iter(stream)

    def __aiter__(self) -> AsyncIterator[ResponseEvent]:
        return self

    async def __anext__(self) -> ResponseEvent:
        event = await asyncio.to_thread(next, self._events, None)
        if event is None:
            raise StopAsyncIteration
        return event

    async def get_final_response(self) -> Response:
        return await asyncio.to_thread(self._stream.get_final_response)

    async def close(self) -> None:
        await asyncio.to_thread(self._stream.close)

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(
        self, kind: type[BaseException] | None, error: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.close()


class Responses:
    def __init__(self, client: GatewayHttpConnection) -> None:
        self._client = client

    @cached_property
    def with_raw_response(self) -> ResponsesWithRawResponse:
        """The calls answering an `APIResponse`: the gateway's headers (`request_id`, `rate_limits`) and `parse()`."""
        return ResponsesWithRawResponse(self)

    @cached_property
    def with_streaming_response(self) -> ResponsesWithStreamingResponse:
        """The calls answering a `StreamedAPIResponse` in a `with` block, before the body is read: `stream`'s
        server-sent events line by line with `iter_lines()`, or `parse()` for the usual result."""
        return ResponsesWithStreamingResponse(self)

    @_CREATE_PARAMETERS.expand
    def create(self, *, background: bool = False, **params: Unpack[ResponseCreateParams]) -> Response:
        """Answers `input` (after `instructions`, and after the stored response `previous_response_id`). Stored
        unless `store=False`; `background=True` answers at once (status "queued") and runs on: `retrieve`
        polls it, `cancel` stops it. `text={"format": {"type": "json_schema", "name", "schema"}}` makes the
        answer JSON that follows the schema; `tools` (flat function tools) may be called (`Response.output`
        holds `ResponseFunctionCall` items; answer them with `function_call_output` input items).
        `truncation="auto"` drops the oldest items of a conversation too long for the context.

        `idempotency_key` (a fresh UUID when omitted) is sent on every retry, so the gateway runs and bills the
        request once; `extra_body` adds fields to the body, `extra_headers` headers, `extra_query` query
        parameters."""
        arguments = _CREATE_PARAMETERS.complete(params)
        body = {**_body(arguments), **({"background": True} if background else {})}
        return self._request("POST", "/responses", _response, _create_options(arguments), body=body)

    @_CREATE_PARAMETERS.expand
    def stream(self, **params: Unpack[ResponseCreateParams]) -> ResponseStream:
        """`create`, streamed: iterate the `ResponseEvent`s as they come; `get_final_response()` reads to the end."""
        arguments = _CREATE_PARAMETERS.complete(params)
        body = {**_body(arguments), "stream": True}
        parse = _response_stream
        return self._request("POST", "/responses", parse, _create_options(arguments), body=body, events=True)

    @_OPTIONS.expand
    def retrieve(self, response_id: str, **options: Unpack[RequestOptions]) -> Response:
        path = f"/responses/{segment(response_id)}"
        return self._request("GET", path, _response, _OPTIONS.complete(options))

    @_OPTIONS.expand
    def delete(self, response_id: str, **options: Unpack[RequestOptions]) -> bool:
        path = f"/responses/{segment(response_id)}"
        return self._request("DELETE", path, _deleted, _OPTIONS.complete(options))

    @_OPTIONS.expand
    def cancel(self, response_id: str, **options: Unpack[RequestOptions]) -> Response:
        """Stops a background response; what it produced until then stays its output (and is billed, once)."""
        path = f"/responses/{segment(response_id)}/cancel"
        return self._request("POST", path, _response, _OPTIONS.complete(options))

    @_OPTIONS.expand
    def input_items(
        self,
        response_id: str,
        *,
        limit: int = 20,
        after: str | None = None,
        order: Literal["asc", "desc"] = "desc",
        **options: Unpack[RequestOptions],
    ) -> CursorPage[ResponseInputItem]:
        """A page of the response's input items, newest first unless `order="asc"`; iterating walks them all."""
        options = _OPTIONS.complete(options)

        def parse(response: StreamedAPIResponse[Any]) -> CursorPage[ResponseInputItem]:
            page = input_items_page_from_json(json_object(response))
            following = partial(self.input_items, response_id, limit=limit, after=page.last_id, order=order, **options)
            return dataclasses.replace(page, _next_page=following)

        query = {"limit": limit, "after": after, "order": order}
        return self._request("GET", f"/responses/{segment(response_id)}/input_items", parse, options, query=query)

    def _request(
        self,
        method: str,
        path: str,
        parse: Callable[[StreamedAPIResponse[Any]], T],
        options: RequestOptions | PostRequestOptions,
        *,
        body: object = None,
        query: Mapping[str, object] | None = None,
        events: bool = False,
    ) -> T:
        client = self._client
        return client._http_transport.request(
            method,
            path,
            parse=parse,
            query=query,
            body=body,
            options=options,
            events=events,
            timeout=client.timeout,
            max_retries=client.max_retries,
        )


class AsyncResponses:
    """The asyncio twin of `Responses`; each call runs in a worker thread."""

    def __init__(self, client: GatewayHttpConnection) -> None:
        self._sync = Responses(client)

    @cached_property
    def with_raw_response(self) -> AsyncResponsesWithRawResponse:
        return AsyncResponsesWithRawResponse(self)

    @cached_property
    def with_streaming_response(self) -> AsyncResponsesWithStreamingResponse:
        return AsyncResponsesWithStreamingResponse(self)

    @_CREATE_PARAMETERS.expand
    async def create(self, *, background: bool = False, **params: Unpack[ResponseCreateParams]) -> Response:
        return await asyncio.to_thread(partial(self._sync.create, background=background, **params))

    @_CREATE_PARAMETERS.expand
    async def stream(self, **params: Unpack[ResponseCreateParams]) -> AsyncResponseStream:
        return then(await asyncio.to_thread(partial(self._sync.stream, **params)), AsyncResponseStream)

    @_OPTIONS.expand
    async def retrieve(self, response_id: str, **options: Unpack[RequestOptions]) -> Response:
        return await asyncio.to_thread(partial(self._sync.retrieve, response_id, **options))

    @_OPTIONS.expand
    async def delete(self, response_id: str, **options: Unpack[RequestOptions]) -> bool:
        return await asyncio.to_thread(partial(self._sync.delete, response_id, **options))

    @_OPTIONS.expand
    async def cancel(self, response_id: str, **options: Unpack[RequestOptions]) -> Response:
        return await asyncio.to_thread(partial(self._sync.cancel, response_id, **options))

    @_OPTIONS.expand
    async def input_items(
        self,
        response_id: str,
        *,
        limit: int = 20,
        after: str | None = None,
        order: Literal["asc", "desc"] = "desc",
        **options: Unpack[RequestOptions],
    ) -> AsyncCursorPage[ResponseInputItem]:
        page = await asyncio.to_thread(
            partial(self._sync.input_items, response_id, limit=limit, after=after, order=order, **options)
        )

        def asynchronous(page: CursorPage[ResponseInputItem]) -> AsyncCursorPage[ResponseInputItem]:
            following = partial(self.input_items, response_id, limit=limit, after=page.last_id, order=order, **options)
            return AsyncCursorPage(data=page.data, has_more=page.has_more, last_id=page.last_id, _next_page=following)

        return then(page, asynchronous)


def _response(answer: StreamedAPIResponse[Any]) -> Response:
    return response_from_json(json_object(answer))


def _deleted(answer: StreamedAPIResponse[Any]) -> bool:
    return bool(json_object(answer).get("deleted"))


def _response_stream(answer: StreamedAPIResponse[Any]) -> ResponseStream:
    return ResponseStream(events(answer))


def _body(arguments: Mapping[str, object]) -> dict[str, object]:
    """The request body: the arguments given (None: left out); the transport adds `extra_body` over them."""
    body = {name: value for name, value in arguments.items() if name not in _CALL_OPTIONS and value is not None}
    for name in ("input", "tools"):  # iterables of mappings, as JSON lists of objects
        value = body.get(name)
        if value is not None and not isinstance(value, str):
            body[name] = [dict(item) for item in cast("Iterable[Mapping[str, object]]", value)]
    return body


def _create_options(arguments: ResponseCreateParams) -> PostRequestOptions:
    """The call's options; its idempotency key a fresh one when it gave none, so that a retry runs it once."""
    key = arguments.get("idempotency_key") or f"diptych-python-{uuid.uuid4()}"
    return {
        "timeout": arguments.get("timeout"),
        "extra_headers": arguments.get("extra_headers"),
        "extra_query": arguments.get("extra_query"),
        "extra_body": arguments.get("extra_body"),
        "idempotency_key": key,
    }


class ResponsesWithRawResponse:
    def __init__(self, resource: Responses) -> None:
        self.create = to_raw_response_wrapper(resource.create)
        self.stream = to_raw_response_wrapper(resource.stream)
        self.retrieve = to_raw_response_wrapper(resource.retrieve)
        self.delete = to_raw_response_wrapper(resource.delete)
        self.cancel = to_raw_response_wrapper(resource.cancel)
        self.input_items = to_raw_response_wrapper(resource.input_items)


class AsyncResponsesWithRawResponse:
    def __init__(self, resource: AsyncResponses) -> None:
        self.create = async_to_raw_response_wrapper(resource.create)
        self.stream = async_to_raw_response_wrapper(resource.stream)
        self.retrieve = async_to_raw_response_wrapper(resource.retrieve)
        self.delete = async_to_raw_response_wrapper(resource.delete)
        self.cancel = async_to_raw_response_wrapper(resource.cancel)
        self.input_items = async_to_raw_response_wrapper(resource.input_items)


class ResponsesWithStreamingResponse:
    def __init__(self, resource: Responses) -> None:
        self.create = to_streamed_response_wrapper(resource.create)
        self.stream = to_streamed_response_wrapper(resource.stream)
        self.retrieve = to_streamed_response_wrapper(resource.retrieve)
        self.delete = to_streamed_response_wrapper(resource.delete)
        self.cancel = to_streamed_response_wrapper(resource.cancel)
        self.input_items = to_streamed_response_wrapper(resource.input_items)


class AsyncResponsesWithStreamingResponse:
    def __init__(self, resource: AsyncResponses) -> None:
        self.create = async_to_streamed_response_wrapper(resource.create)
        self.stream = async_to_streamed_response_wrapper(resource.stream)
        self.retrieve = async_to_streamed_response_wrapper(resource.retrieve)
        self.delete = async_to_streamed_response_wrapper(resource.delete)
        self.cancel = async_to_streamed_response_wrapper(resource.cancel)
        self.input_items = async_to_streamed_response_wrapper(resource.input_items)
