"""The admin API's HTTP transport: JSON over the standard library's urllib, with the SDK's retries.

The admin API is small and infrequent, so it needs no HTTP dependency. The asyncio client runs
these calls in a worker thread.
"""

from __future__ import annotations

import json
import urllib.error
import urllib.request
import uuid
from collections.abc import Callable, Mapping
from http.client import HTTPException, HTTPResponse
from typing import Any, TypeVar, cast
from urllib.parse import urlencode, urlsplit

from ._errors import APIConnectionError, APIResponseValidationError, APITimeoutError, error_from_http
from ._response import StreamedAPIResponse, record_headers, streaming_requested
from ._retry import with_retries
from ._version import __version__
from .types import PostRequestOptions, RequestOptions

R = TypeVar("R")

DEFAULT_ADMIN_URL = "http://127.0.0.1:8000"
_API_PREFIX = "/api/v1"
_SERVICE = "the admin API"


def parse_base_url(url: str, name: str, example: str) -> str:
    """Checks `http(s)://host[:port][/prefix]` and returns it without a trailing slash; ValueError naming the
    setting (`name`) and how it looks (`example`) otherwise."""
    parts = urlsplit(url)
    try:
        valid_port = parts.port is None or parts.port > 0
    except ValueError:
        valid_port = False
    if parts.scheme not in ("http", "https") or not parts.hostname or not valid_port or parts.query or parts.fragment:
        raise ValueError(f"{name} {url!r} must look like {example}")
    return url.rstrip("/")


def open_url(
    opener: urllib.request.OpenerDirector,
    request: urllib.request.Request,
    timeout: float | None,
    *,
    service: str,
    idempotent: bool,
) -> HTTPResponse:
    """The answer to `request`, or the SDK's error: the server's (by its status) or the connection's."""
    try:
        return cast(HTTPResponse, opener.open(request, timeout=timeout))
    except urllib.error.HTTPError as failure:
        raise error_from_http(
            failure.code,
            _decode_error(failure.read()),
            failure.headers,
            request_id=failure.headers.get("X-Request-Id"),
        ) from None
    except (urllib.error.URLError, OSError, HTTPException) as failure:
        raise transport_error(failure, service=service, idempotent=idempotent) from failure


def transport_error(failure: Exception, *, service: str, idempotent: bool) -> APIConnectionError:
    """The error of a call to `service` ("the admin API") whose connection failed: `connection_lost` when the
    server may have acted on a call that is not safe to repeat."""
    reason = getattr(failure, "reason", failure)
    if isinstance(reason, TimeoutError):
        return APITimeoutError(f"No answer in time from {service}: {reason}", code="timeout")
    never_sent = isinstance(reason, ConnectionRefusedError)
    code = "connection_error" if idempotent or never_sent else "connection_lost"
    return APIConnectionError(f"Could not reach {service}: {reason}", code=code)


class AdminTransport:
    """Sends admin API requests authenticated with the client's API key."""

    def __init__(self, admin_url: str, api_key: str) -> None:
        self.admin_url = parse_base_url(admin_url, "admin_url", "http://host:port or https://host")
        self._headers = {
            "Authorization": f"Bearer {api_key}",
            "Accept": "application/json",
            "User-Agent": f"diptych-python/{__version__}",
        }
        self._opener = urllib.request.build_opener()

    def request(
        self,
        method: str,
        path: str,
        *,
        parse: Callable[[StreamedAPIResponse[Any]], R],
        query: Mapping[str, object] | None = None,
        body: object = None,
        content: tuple[bytes, str] | None = None,
        options: RequestOptions | PostRequestOptions | None = None,
        timeout: float | None,
        max_retries: int,
    ) -> R:
        """Sends the request and returns `parse` of its answer (`json_body`: its decoded JSON), retrying transient
        failures. `content` is a body of another kind (bytes, content type) than JSON. `options` are the call's:
        its timeout (over `timeout`, the client's), extra headers, query and body fields, idempotency key. Under
        `with_streaming_response` the answer is the `StreamedAPIResponse`, its body unread.

        A POST carries an Idempotency-Key (the caller's, or a fresh one), the same on every retry of this call,
        so the server acts on it at most once and a retry after a lost connection gets the first answer back.
        Any other request that is not a GET is retried only when the server certainly did not act on it
        (connection refused, 429, 503).
        """
        options = options or {}
        url = f"{self.admin_url}{_API_PREFIX}{path}" + query_string(query, options.get("extra_query"))
        data, content_type = request_payload(method, body, content, options.get("extra_body"))
        headers = {**self._headers, **({"Content-Type": content_type} if content_type else {})}
        headers.update(options.get("extra_headers") or {})
        if method == "POST":
            headers["Idempotency-Key"] = idempotency_key(options) or f"diptych-python-retry-{uuid.uuid4()}"
        retry_safe = method == "GET" or "Idempotency-Key" in headers
        deadline = call_timeout(options, timeout)

        def attempt(read: bool) -> StreamedAPIResponse[R]:
            request = urllib.request.Request(url, data=data, method=method, headers=headers)
            opened = open_url(self._opener, request, deadline, service=_SERVICE, idempotent=retry_safe)
            answer = StreamedAPIResponse(opened, parse, method=method, url=url)
            if read:
                try:
                    with answer.http_response:
                        answer.parse()
                except (OSError, HTTPException) as failure:
                    raise transport_error(failure, service=_SERVICE, idempotent=retry_safe) from failure
            return answer

        if streaming_requested():
            return cast(R, with_retries(lambda: attempt(read=False), max_retries=max_retries))
        answer = with_retries(lambda: attempt(read=True), max_retries=max_retries)
        record_headers(answer.headers.items())
        return answer.parse()


def json_body(response: StreamedAPIResponse[Any]) -> object:
    """The answer's decoded JSON (None for an empty body)."""
    return _decode(response.read(), response.status_code)


def raw_body(response: StreamedAPIResponse[Any]) -> bytes:
    return response.read()


def idempotency_key(options: Mapping[str, object]) -> str | None:
    """The call's own idempotency key, if it gave one."""
    key = options.get("idempotency_key")
    if key is None:
        return None
    if not isinstance(key, str) or not key or len(key) > 255 or not key.isascii() or not key.isprintable():
        raise ValueError("idempotency_key must be a non-empty string of at most 255 printable ASCII characters")
    return key


def call_timeout(options: Mapping[str, object], timeout: float | None) -> float | None:
    """The call's own timeout when it gave one, else the client's."""
    own = options.get("timeout")
    if own is None:
        return timeout
    if isinstance(own, bool) or not isinstance(own, (int, float)) or not own > 0:
        raise ValueError(f"timeout must be a positive number of seconds or None, not {own!r}")
    return float(own)


def query_string(query: Mapping[str, object] | None, extra_query: Mapping[str, object] | None) -> str:
    """`?name=value&...` of the query's given values (None: left out), then `extra_query`'s over them."""
    merged = {name: value for name, value in (query or {}).items() if value is not None}
    if extra_query is not None and not isinstance(extra_query, Mapping):
        raise ValueError(f"extra_query must be a mapping of names to values, not {extra_query!r}")
    merged.update(extra_query or {})
    return "?" + urlencode(merged, doseq=True) if merged else ""


def request_payload(
    method: str, body: object, content: tuple[bytes, str] | None, extra_body: Mapping[str, object] | None
) -> tuple[bytes | None, str | None]:
    """The request's bytes and content type: `content` as it is, or the JSON of `body` with `extra_body`'s
    fields over its own."""
    if extra_body is not None and not isinstance(extra_body, Mapping):
        raise ValueError(f"extra_body must be a mapping of field names to values, not {extra_body!r}")
    if extra_body:
        if method in ("GET", "DELETE"):
            raise ValueError(f"extra_body: a {method} request has no body; send the fields with extra_query")
        if content is not None or not isinstance(body, dict | None):
            raise ValueError("extra_body: this call's body is not a JSON object to add fields to")
        body = {**(body or {}), **extra_body}
    if content is not None:
        return content
    if body is None:
        return None, None
    return json.dumps(body).encode(), "application/json"


def _decode(raw: bytes, status: int) -> object:
    if not raw:
        return None
    try:
        return json.loads(raw)
    except ValueError:
        raise APIResponseValidationError(f"The admin API answered {status} with a body that is not JSON") from None


def _decode_error(raw: bytes) -> object:
    try:
        return json.loads(raw)
    except ValueError:
        return None
