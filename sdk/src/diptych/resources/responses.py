"""The Responses API: `client.responses` (create, stream, retrieve, delete, cancel, input_items), over the
gateway's HTTP API (`http_url`, OpenAI's shapes). A response is stored by default; one that continues it
(`previous_response_id`) runs on its conversation's token ids, so the prefix cache holds most of its prompt.

The asyncio twins run each call in a worker thread.
"""

from __future__ import annotations

import asyncio
import dataclasses
import uuid
from collections.abc import AsyncIterator, Iterable, Iterator, Mapping
from functools import cached_property, partial
from types import TracebackType
from typing import Literal, Self, Unpack, cast
from urllib.parse import quote

from .._errors import APIResponseValidationError
from .._response import async_to_raw_response_wrapper, to_raw_response_wrapper
from .._responses_convert import event_from_json, input_items_page_from_json, response_from_json
from ..types import AsyncCursorPage, CursorPage, Response, ResponseCreateParams, ResponseEvent, ResponseInputItem
from ._connections import GatewayHttpConnection
from ._keyword_parameters import KeywordParameters

__all__ = ["Responses", "AsyncResponses", "ResponseStream", "AsyncResponseStream"]

_CREATE_PARAMETERS = KeywordParameters(ResponseCreateParams)
_CALL_OPTIONS = ("timeout", "idempotency_key", "extra_headers", "extra_body")
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

    @_CREATE_PARAMETERS.expand
    def create(self, *, background: bool = False, **params: Unpack[ResponseCreateParams]) -> Response:
        """Answers `input` (after `instructions`, and after the stored response `previous_response_id`). Stored
        unless `store=False`; `background=True` answers at once (status "queued") and runs on: `retrieve`
        polls it, `cancel` stops it. `text={"format": {"type": "json_schema", "name", "schema"}}` makes the
        answer JSON that follows the schema; `tools` (flat function tools) may be called (`Response.output`
        holds `ResponseFunctionCall` items; answer them with `function_call_output` input items).
        `truncation="auto"` drops the oldest items of a conversation too long for the context.

        `idempotency_key` (a fresh UUID when omitted) is sent on every retry, so the gateway runs and bills the
        request once; `extra_body` adds fields to the body, `extra_headers` headers."""
        arguments = _CREATE_PARAMETERS.complete(params)
        body = {**_body(arguments), **({"background": True} if background else {})}
        return response_from_json(self._request("POST", "/responses", arguments, body))

    @_CREATE_PARAMETERS.expand
    def stream(self, **params: Unpack[ResponseCreateParams]) -> ResponseStream:
        """`create`, streamed: iterate the `ResponseEvent`s as they come; `get_final_response()` reads to the end."""
        arguments = _CREATE_PARAMETERS.complete(params)
        client = self._client
        events = client._http_transport.stream(
            "/responses",
            {**_body(arguments), "stream": True},
            headers=_headers(arguments),
            timeout=arguments.get("timeout") or client.timeout,
            max_retries=client.max_retries,
        )
        return ResponseStream(events)

    def retrieve(self, response_id: str) -> Response:
        return response_from_json(self._request("GET", f"/responses/{_segment(response_id)}"))

    def delete(self, response_id: str) -> bool:
        return bool(self._request("DELETE", f"/responses/{_segment(response_id)}").get("deleted"))

    def cancel(self, response_id: str) -> Response:
        """Stops a background response; what it produced until then stays its output (and is billed, once)."""
        return response_from_json(self._request("POST", f"/responses/{_segment(response_id)}/cancel"))

    def input_items(
        self, response_id: str, *, limit: int = 20, after: str | None = None, order: Literal["asc", "desc"] = "desc"
    ) -> CursorPage[ResponseInputItem]:
        """A page of the response's input items, newest first unless `order="asc"`; iterating walks them all."""
        query = {"limit": limit, "after": after, "order": order}
        page = input_items_page_from_json(
            self._request("GET", f"/responses/{_segment(response_id)}/input_items", query=query)
        )
        following = partial(self.input_items, response_id, limit=limit, after=page.last_id, order=order)
        return dataclasses.replace(page, _next_page=following)

    def _request(
        self,
        method: str,
        path: str,
        arguments: Mapping[str, object] | None = None,
        body: object = None,
        query: Mapping[str, object] | None = None,
    ) -> dict[str, object]:
        client = self._client
        timeout = cast("float | None", (arguments or {}).get("timeout")) or client.timeout
        answer = client._http_transport.request(
            method,
            path,
            query=query,
            body=body,
            headers=_headers(arguments) if arguments is not None else None,
            timeout=timeout,
            max_retries=client.max_retries,
        )
        assert isinstance(answer, dict)
        return answer


class AsyncResponses:
    """The asyncio twin of `Responses`; each call runs in a worker thread."""

    def __init__(self, client: GatewayHttpConnection) -> None:
        self._sync = Responses(client)

    @cached_property
    def with_raw_response(self) -> AsyncResponsesWithRawResponse:
        return AsyncResponsesWithRawResponse(self)

    @_CREATE_PARAMETERS.expand
    async def create(self, *, background: bool = False, **params: Unpack[ResponseCreateParams]) -> Response:
        return await asyncio.to_thread(partial(self._sync.create, background=background, **params))

    @_CREATE_PARAMETERS.expand
    async def stream(self, **params: Unpack[ResponseCreateParams]) -> AsyncResponseStream:
        return AsyncResponseStream(await asyncio.to_thread(partial(self._sync.stream, **params)))

    async def retrieve(self, response_id: str) -> Response:
        return await asyncio.to_thread(self._sync.retrieve, response_id)

    async def delete(self, response_id: str) -> bool:
        return await asyncio.to_thread(self._sync.delete, response_id)

    async def cancel(self, response_id: str) -> Response:
        return await asyncio.to_thread(self._sync.cancel, response_id)

    async def input_items(
        self, response_id: str, *, limit: int = 20, after: str | None = None, order: Literal["asc", "desc"] = "desc"
    ) -> AsyncCursorPage[ResponseInputItem]:
        page = await asyncio.to_thread(self._sync.input_items, response_id, limit=limit, after=after, order=order)
        following = partial(self.input_items, response_id, limit=limit, after=page.last_id, order=order)
        return AsyncCursorPage(data=page.data, has_more=page.has_more, last_id=page.last_id, _next_page=following)


def _body(arguments: Mapping[str, object]) -> dict[str, object]:
    """The request body: the arguments given (None: left out), then `extra_body` over them."""
    body = {name: value for name, value in arguments.items() if name not in _CALL_OPTIONS and value is not None}
    for name in ("input", "tools"):  # iterables of mappings, as JSON lists of objects
        value = body.get(name)
        if value is not None and not isinstance(value, str):
            body[name] = [dict(item) for item in cast("Iterable[Mapping[str, object]]", value)]
    return {**body, **dict(cast("Mapping[str, object]", arguments.get("extra_body") or {}))}


def _headers(arguments: Mapping[str, object]) -> dict[str, str]:
    key = str(arguments.get("idempotency_key") or f"diptych-python-{uuid.uuid4()}")
    return {**dict(cast("Mapping[str, str]", arguments.get("extra_headers") or {})), "Idempotency-Key": key}


def _segment(identifier: str) -> str:
    return quote(identifier, safe="")


class ResponsesWithRawResponse:
    def __init__(self, resource: Responses) -> None:
        self.create = to_raw_response_wrapper(resource.create)
        self.retrieve = to_raw_response_wrapper(resource.retrieve)
        self.delete = to_raw_response_wrapper(resource.delete)
        self.cancel = to_raw_response_wrapper(resource.cancel)
        self.input_items = to_raw_response_wrapper(resource.input_items)


class AsyncResponsesWithRawResponse:
    def __init__(self, resource: AsyncResponses) -> None:
        self.create = async_to_raw_response_wrapper(resource.create)
        self.retrieve = async_to_raw_response_wrapper(resource.retrieve)
        self.delete = async_to_raw_response_wrapper(resource.delete)
        self.cancel = async_to_raw_response_wrapper(resource.cancel)
        self.input_items = async_to_raw_response_wrapper(resource.input_items)
