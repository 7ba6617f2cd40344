"""The gateway's HTTP API (`http_url`, OpenAI's shapes), for the calls the gRPC API does not carry (the
Responses API): JSON over the standard library's urllib, with the SDK's retries, and server-sent events read
line by line. The asyncio client runs these calls in a worker thread.
"""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator, Mapping
from http.client import HTTPException, HTTPResponse
from typing import Any, TypeVar, cast

from ._errors import APIResponseValidationError
from ._http import (
    call_timeout,
    idempotency_key,
    open_url,
    parse_base_url,
    query_string,
    request_payload,
    transport_error,
)
from ._response import StreamedAPIResponse, record_headers, streaming_requested
from ._retry import with_retries
from ._version import __version__
from .types import PostRequestOptions, RequestOptions

R = TypeVar("R")

DEFAULT_HTTP_URL = "http://127.0.0.1:8080/v1"
_SERVICE = "the gateway's HTTP API"


class GatewayHttpTransport:
    """Sends requests to the gateway's HTTP API, authenticated with the client's API key."""

    def __init__(self, http_url: str, api_key: str) -> None:
        self.http_url = parse_base_url(http_url, "http_url", "http://host:port/v1 or https://host/v1")
        self._headers = {"Authorization": f"Bearer {api_key}", "User-Agent": f"diptych-python/{__version__}"}
        self._opener = urllib.request.build_opener()

    def request(
        self,
        method: str,
        path: str,
        *,
        parse: Callable[[StreamedAPIResponse[Any]], R],
        query: Mapping[str, object] | None = None,
        body: object = None,
        options: RequestOptions | PostRequestOptions | None = None,
        events: bool = False,
        timeout: float | None,
        max_retries: int,
    ) -> R:
        """`parse` of the answer (`json_object`: its JSON object). A POST is retried only when it carries an
        Idempotency-Key (`options["idempotency_key"]`; the gateway then runs it once); a GET or DELETE when the
        gateway did not answer or asked to retry. With `events` the answer is a stream of server-sent events:
        `parse` gets it unread, and only opening it is retried (the caller would see events twice). Under
        `with_streaming_response` the answer is the `StreamedAPIResponse`, its body unread."""
        options = options or {}
        url = f"{self.http_url}{path}" + query_string(query, options.get("extra_query"))
        data, content_type = request_payload(method, body, None, options.get("extra_body"))
        accept = "text/event-stream" if events else "application/json"
        headers = {**self._headers, "Accept": accept, **({"Content-Type": content_type} if content_type else {})}
        headers.update(options.get("extra_headers") or {})
        key = idempotency_key(options)
        if key is not None:
            headers["Idempotency-Key"] = key
        deadline = call_timeout(options, timeout)
        retries = max_retries if self._retry_safe(method, headers) else 0

        def attempt(read: bool) -> StreamedAPIResponse[R]:
            answer = StreamedAPIResponse(
                self._open(method, url, data, headers, deadline), parse, method=method, url=url
            )
            if read:
                try:
                    with answer.http_response:
                        answer.parse()
                except (OSError, HTTPException) as failure:
                    raise transport_error(
                        failure, service=_SERVICE, idempotent=self._retry_safe(method, headers)
                    ) from failure
            return answer

        if streaming_requested():
            return cast(R, with_retries(lambda: attempt(read=False), max_retries=retries))
        answer = with_retries(lambda: attempt(read=not events), max_retries=retries)
        record_headers(answer.headers.items())
        return answer.parse()

    def _open(
        self, method: str, url: str, data: bytes | None, headers: dict[str, str], timeout: float | None
    ) -> HTTPResponse:
        request = urllib.request.Request(url, data=data, method=method, headers=headers)
        return open_url(self._opener, request, timeout, service=_SERVICE, idempotent=self._retry_safe(method, headers))

    @staticmethod
    def _retry_safe(method: str, headers: Mapping[str, str]) -> bool:
        return method != "POST" or "Idempotency-Key" in headers


def json_object(response: StreamedAPIResponse[Any]) -> dict[str, object]:
    """The answer's JSON, which must be an object."""
    return _decode(response.read(), response.status_code)


def events(response: StreamedAPIResponse[Any]) -> Iterator[dict[str, object]]:
    """The `data:` of each server-sent event, until the stream ends; closes the response when done or dropped."""
    with response.http_response:
        data: list[str] = []
        for line in response.iter_lines():
            if line.startswith("data:"):
                data.append(line[5:].lstrip())
            elif not line and data:
                yield _decode("\n".join(data).encode(), response.status_code)
                data = []


def _decode(raw: bytes, status: int) -> dict[str, object]:
    try:
        body = json.loads(raw)
    except ValueError:
        raise APIResponseValidationError(f"The gateway answered {status} with a body that is not JSON") from None
    if not isinstance(body, dict):
        raise APIResponseValidationError(f"The gateway answered {status} with JSON that is not an object")
    return body
