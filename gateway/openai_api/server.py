"""The HTTP front's server: aiohttp's, with the same limits, answering what its HTTP parser refuses (a control
character in a header, a request line or header over 8190 bytes, over 128 headers) in OpenAI's JSON error
shape, as every other error of the gateway is answered.

aiohttp answers those before any route or middleware runs, from its connection handler's `handle_error`, with a
text/plain 400; `JsonErrorAppRunner` serves the application through a handler whose `handle_error` writes JSON.
"""

import uuid

from aiohttp import web
from aiohttp.http_exceptions import BadHttpMessage, LineTooLong
from aiohttp.web_protocol import RequestHandler

MAX_HEAD_LINE_BYTES = 8190  # aiohttp's default max_line_size and max_field_size, kept
REQUEST_ID_HEADER = "X-Request-Id"


def name_answer(response: web.StreamResponse) -> None:
    """Gives an answer no execution names an id of its own (`req_` and 32 hex digits): every answer carries
    one, as OpenAI's do, for a client to quote."""
    response.headers.setdefault(REQUEST_ID_HEADER, f"req_{uuid.uuid4().hex}")


class JsonErrorAppRunner(web.AppRunner):
    """An `AppRunner` whose connections answer errors outside the application in OpenAI's JSON shape, and
    leave a body as it was sent: the application inflates it (`bodies.py`, which says why)."""

    async def _make_server(self) -> web.Server:
        server = await super()._make_server()
        return _JsonErrorServer(
            server.request_handler,
            request_factory=server.request_factory,
            handler_cancellation=server.handler_cancellation,
            **{**server._kwargs, "auto_decompress": False},
        )


class _JsonErrorServer(web.Server):
    def __call__(self) -> RequestHandler:
        return _JsonErrorRequestHandler(self, loop=self._loop, **self._kwargs)


class _JsonErrorRequestHandler(RequestHandler):
    def handle_error(
        self,
        request: web.BaseRequest,
        status: int = 500,
        exc: BaseException | None = None,
        message: str | None = None,
    ) -> web.StreamResponse:
        super().handle_error(request, status, exc, message)  # logs it; raises if an answer had started
        response = web.json_response({"error": _error_fields(status, exc)}, status=status)
        name_answer(response)
        response.force_close()
        return response


def _error_fields(status: int, exc: BaseException | None) -> dict[str, str | None]:
    if status >= 500:
        kind = "timeout" if status == 504 else "server_error"
        return {
            "message": "the gateway failed to answer this request; retry it",
            "type": kind,
            "param": None,
            "code": None,
        }
    return {"message": _refusal(exc), "type": "invalid_request_error", "param": None, "code": None}


def _refusal(exc: BaseException | None) -> str:
    """What was wrong with the request's head and what to send instead, without echoing the client's bytes."""
    if isinstance(exc, LineTooLong):
        return f"the request line or a header line is over {MAX_HEAD_LINE_BYTES} bytes; send a shorter URL and headers"
    reason = exc.message.split(":", 1)[0].strip() if isinstance(exc, BadHttpMessage) else ""
    return (
        f"the request's HTTP head is malformed ({reason or 'unreadable'}); send header names and values of "
        "printable ASCII characters, at most 128 headers"
    )
