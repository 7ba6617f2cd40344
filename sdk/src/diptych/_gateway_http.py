"""The gateway's HTTP API (`http_url`, OpenAI's shapes), for the calls the gRPC API does not carry (the
Responses API): JSON over the standard library's urllib, with the SDK's retries, and server-sent events read
line by line. The asyncio client runs these calls in a worker thread.
"""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from collections.abc import Iterator, Mapping
from http.client import HTTPException, HTTPResponse
from typing import cast
from urllib.parse import urlencode, urlsplit

from ._errors import APIConnectionError, APIResponseValidationError, APITimeoutError, error_from_http
from ._response import record_headers
from ._retry import with_retries
from ._version import __version__

DEFAULT_HTTP_URL = "http://127.0.0.1:8080/v1"


def parse_http_url(http_url: str) -> str:
    """Checks `http(s)://host[:port][/prefix]` and returns it without a trailing slash."""
    parts = urlsplit(http_url)
    try:
        valid_port = parts.port is None or parts.port > 0
    except ValueError:
        valid_port = False
    if parts.scheme not in ("http", "https") or not parts.hostname or not valid_port or parts.query or parts.fragment:
        raise ValueError(f"http_url {http_url!r} must look like http://host:port/v1 or https://host/v1")
    return http_url.rstrip("/")


class GatewayHttpTransport:
    """Sends requests to the gateway's HTTP API, authenticated with the client's API key."""

    def __init__(self, http_url: str, api_key: str) -> None:
        self.http_url = parse_http_url(http_url)
        self._headers = {"Authorization": f"Bearer {api_key}", "User-Agent": f"diptych-python/{__version__}"}
        self._opener = urllib.request.build_opener()

    def request(
        self,
        method: str,
        path: str,
        *,
        query: Mapping[str, object] | None = None,
        body: object = None,
        headers: Mapping[str, str] | None = None,
        timeout: float | None,
        max_retries: int,
    ) -> object:
        """The answer's JSON. A POST is retried only when it carries an Idempotency-Key (the gateway then runs
        it once); a GET or DELETE when the gateway did not answer or asked to retry."""
        request_headers = {**self._headers, "Accept": "application/json", **(headers or {})}

        def attempt() -> object:
            with self._open(method, path, query, body, request_headers, timeout) as response:
                answer = _decode(response.read(), response.status)
                record_headers(response.headers.items())
                return answer

        return with_retries(attempt, max_retries=max_retries if self._retry_safe(method, request_headers) else 0)

    def stream(
        self,
        path: str,
        body: object,
        *,
        headers: Mapping[str, str] | None = None,
        timeout: float | None,
        max_retries: int,
    ) -> Iterator[dict[str, object]]:
        """The events of a streamed POST, each as its JSON; opening it is retried as `request` retries, what
        follows never (the caller would see events twice)."""
        request_headers = {**self._headers, "Accept": "text/event-stream", **(headers or {})}
        retries = max_retries if self._retry_safe("POST", request_headers) else 0
        response = with_retries(
            lambda: self._open("POST", path, None, body, request_headers, timeout), max_retries=retries
        )
        record_headers(response.headers.items())
        return _events(response)

    def _open(
        self,
        method: str,
        path: str,
        query: Mapping[str, object] | None,
        body: object,
        headers: dict[str, str],
        timeout: float | None,
    ) -> HTTPResponse:
        url = f"{self.http_url}{path}"
        if query:
            url += "?" + urlencode({name: value for name, value in query.items() if value is not None})
        data = None if body is None else json.dumps(body).encode()
        if data is not None:
            headers = {**headers, "Content-Type": "application/json"}
        request = urllib.request.Request(url, data=data, method=method, headers=headers)
        try:
            return cast(HTTPResponse, self._opener.open(request, timeout=timeout))
        except urllib.error.HTTPError as failure:
            raise error_from_http(
                failure.code,
                _decode_error(failure.read()),
                failure.headers,
                request_id=failure.headers.get("X-Request-Id"),
            ) from None
        except (urllib.error.URLError, OSError, HTTPException) as failure:
            raise _transport_error(failure, idempotent=self._retry_safe(method, headers)) from failure

    @staticmethod
    def _retry_safe(method: str, headers: Mapping[str, str]) -> bool:
        return method != "POST" or "Idempotency-Key" in headers


def _events(response: HTTPResponse) -> Iterator[dict[str, object]]:
    """The `data:` of each server-sent event, until the stream ends; closes the response when done or dropped."""
    with response:
        data: list[str] = []
        for raw in response:
            line = raw.decode("utf-8").rstrip("\r\n")
            if line.startswith("data:"):
                data.append(line[5:].lstrip())
            elif not line and data:
                yield _decode("\n".join(data).encode(), response.status)
                data = []


def _transport_error(failure: Exception, *, idempotent: bool) -> APIConnectionError:
    reason = getattr(failure, "reason", failure)
    if isinstance(reason, TimeoutError):
        return APITimeoutError(f"The gateway did not answer in time: {reason}", code="timeout")
    never_sent = isinstance(reason, ConnectionRefusedError)
    code = "connection_error" if idempotent or never_sent else "connection_lost"
    return APIConnectionError(f"Could not reach the gateway's HTTP API: {reason}", code=code)


def _decode(raw: bytes, status: int) -> dict[str, object]:
    try:
        body = json.loads(raw)
    except ValueError:
        raise APIResponseValidationError(f"The gateway answered {status} with a body that is not JSON") from None
    if not isinstance(body, dict):
        raise APIResponseValidationError(f"The gateway answered {status} with JSON that is not an object")
    return body


def _decode_error(raw: bytes) -> object:
    try:
        return json.loads(raw)
    except ValueError:
        return None
