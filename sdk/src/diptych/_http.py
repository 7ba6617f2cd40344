"""The admin API's HTTP transport: JSON over the standard library's urllib, with the SDK's retries.

The admin API is small and infrequent, so it needs no HTTP dependency. The asyncio client runs
these calls in a worker thread.
"""

from __future__ import annotations

import json
import urllib.error
import urllib.request
import uuid
from collections.abc import Mapping
from http.client import HTTPException
from urllib.parse import urlencode, urlsplit

from ._errors import APIConnectionError, APIResponseValidationError, APITimeoutError, error_from_http
from ._response import record_headers
from ._retry import with_retries
from ._version import __version__

DEFAULT_ADMIN_URL = "http://127.0.0.1:8000"
_API_PREFIX = "/api/v1"


def parse_admin_url(admin_url: str) -> str:
    """Checks `http(s)://host[:port][/prefix]` and returns it without a trailing slash."""
    parts = urlsplit(admin_url)
    try:
        valid_port = parts.port is None or parts.port > 0
    except ValueError:
        valid_port = False
    if parts.scheme not in ("http", "https") or not parts.hostname or not valid_port or parts.query or parts.fragment:
        raise ValueError(f"admin_url {admin_url!r} must look like http://host:port or https://host")
    return admin_url.rstrip("/")


class AdminTransport:
    """Sends admin API requests authenticated with the client's API key."""

    def __init__(self, admin_url: str, api_key: str) -> None:
        self.admin_url = parse_admin_url(admin_url)
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
        query: Mapping[str, object] | None = None,
        body: object = None,
        content: tuple[bytes, str] | None = None,
        raw: bool = False,
        timeout: float | None,
        max_retries: int,
    ) -> object:
        """Sends the request and returns its decoded JSON body, retrying transient failures. `content` is a
        body of another kind (bytes, content type) than JSON; with `raw`, the answer's bytes are returned.

        A POST carries an Idempotency-Key, the same on every retry of this call, so the server acts on
        it at most once and a retry after a lost connection gets the first answer back. Any other
        request that is not a GET is retried only when the server certainly did not act on it
        (connection refused, 429, 503).
        """
        url = f"{self.admin_url}{_API_PREFIX}{path}"
        if query:
            url += "?" + urlencode({name: value for name, value in query.items() if value is not None})
        data = None if body is None else json.dumps(body).encode()
        headers = dict(self._headers)
        if data is not None:
            headers["Content-Type"] = "application/json"
        if content is not None:
            data, headers["Content-Type"] = content
        if method == "POST":
            headers["Idempotency-Key"] = f"diptych-python-retry-{uuid.uuid4()}"
        retry_safe = method == "GET" or "Idempotency-Key" in headers

        def attempt() -> object:
            request = urllib.request.Request(url, data=data, method=method, headers=headers)
            try:
                with self._opener.open(request, timeout=timeout) as response:
                    answer = response.read() if raw else _decode(response.read(), response.status)
                    record_headers(response.headers.items())
                    return answer
            except urllib.error.HTTPError as failure:
                raise error_from_http(
                    failure.code,
                    _decode_error(failure.read()),
                    failure.headers,
                    request_id=failure.headers.get("X-Request-Id"),
                ) from None
            except (urllib.error.URLError, OSError, HTTPException) as failure:
                raise _transport_error(failure, idempotent=retry_safe) from failure

        return with_retries(attempt, max_retries=max_retries)


def _transport_error(failure: Exception, *, idempotent: bool) -> APIConnectionError:
    reason = getattr(failure, "reason", failure)
    if isinstance(reason, TimeoutError):
        return APITimeoutError(f"The admin API did not answer in time: {reason}", code="timeout")
    never_sent = isinstance(reason, ConnectionRefusedError)
    code = "connection_error" if idempotent or never_sent else "connection_lost"
    return APIConnectionError(f"Could not reach the admin API: {reason}", code=code)


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
