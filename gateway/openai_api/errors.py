"""The gateway's errors as OpenAI's error answers: status, type, param and code, with the rate-limit and
Retry-After headers; a path or method the app does not serve, answered with what it does serve."""

import json
import logging
import math
from typing import Any

from aiohttp import hdrs, web
from aiohttp.typedefs import Handler

from gateway.core.pipeline import Admitted
from gateway.openai_api.requests import PARAMS
from gateway.openai_api.server import REQUEST_ID_HEADER
from gateway.planning.validation import PromptTooLong
from gateway.types import ErrorKind, GatewayError, as_told

log = logging.getLogger(__name__)

STATUS = {
    ErrorKind.INVALID_ARGUMENT: (400, "invalid_request_error"),
    ErrorKind.UNAUTHENTICATED: (401, "authentication_error"),
    ErrorKind.PERMISSION_DENIED: (403, "permission_error"),
    ErrorKind.NOT_FOUND: (404, "not_found_error"),
    ErrorKind.RESOURCE_EXHAUSTED: (429, "rate_limit_error"),
    ErrorKind.ABORTED: (409, "conflict_error"),
    ErrorKind.INTERNAL: (500, "server_error"),
    ErrorKind.UNAVAILABLE: (503, "service_unavailable"),
    ErrorKind.DEADLINE_EXCEEDED: (504, "timeout"),
}


@web.middleware
async def json_errors(request: web.Request, handler: Handler) -> web.StreamResponse:
    """Every error answer has OpenAI's JSON shape: aiohttp's own (unknown path, wrong method) too, and a
    defect of ours is a JSON 500 rather than a text page."""
    try:
        return await handler(request)
    except web.HTTPMethodNotAllowed as error:
        return _method_not_allowed(request, error)
    except web.HTTPNotFound as error:
        if request.match_info.route.resource is not None:  # a served path's own 404 (an id it does not hold)
            return json_error(error.status, "invalid_request_error", error.reason, None)
        return _unknown_path(request)
    except web.HTTPException as error:
        if error.status < 400:
            raise
        return json_error(error.status, "invalid_request_error", error.reason, None)
    except Exception:
        log.exception("unexpected error answering %s %s", request.method, request.path)
        return json_error(500, "server_error", "the gateway failed to answer this request; retry it", None)


async def aiohttp_errors_as_json(request: web.Request, response: web.StreamResponse) -> None:
    """An on_response_prepare hook: an error of aiohttp's that no middleware saw gets the JSON shape too. Its
    Expect check runs before the middlewares: any expectation but 100-continue was a text/plain 417."""
    if not isinstance(response, web.HTTPException) or response.status < 400:
        return
    message = response.text or response.reason
    if response.status == 417:
        expect = request.headers.get(hdrs.EXPECT, "")[:64]
        message = f"the Expect header asks for '{expect}', which this server does not meet; send 100-continue or none"
    body = json.dumps({"error": {"message": message, "type": "invalid_request_error", "param": None, "code": None}})
    response.body = body.encode()
    response.content_type = "application/json"
    response.headers[hdrs.CONTENT_LENGTH] = str(len(response.body))  # Response set it from the text before


def served_routes(app: web.Application) -> list[str]:
    """ "METHOD path" of every route the app serves, in the order they were added (HEAD, which aiohttp adds
    beside each GET, and catch-all routes left out)."""
    served: dict[str, None] = {}
    for route in app.router.routes():
        if route.method not in (hdrs.METH_HEAD, hdrs.METH_ANY) and route.resource is not None:
            served[f"{route.method} {route.resource.canonical}"] = None
    return list(served)


def _unknown_path(request: web.Request) -> web.Response:
    message = (
        f"{request.method} {_shown_path(request.path)} is not served by this gateway; it serves "
        f"{', '.join(served_routes(request.app))}"
    )
    return _refusal(404, message, "unknown_url")


def _method_not_allowed(request: web.Request, error: web.HTTPMethodNotAllowed) -> web.Response:
    allowed = sorted(method for method in error.allowed_methods if method != hdrs.METH_ANY)
    message = f"{request.method} is not served on {_shown_path(request.path)}; send {' or '.join(allowed)}"
    response = _refusal(405, message, "method_not_allowed")
    response.headers[hdrs.ALLOW] = ", ".join(allowed)
    return response


def _shown_path(path: str) -> str:
    """The client's path, short enough to quote in an error message."""
    return path if len(path) <= 80 else path[:77] + "..."


def _refusal(status: int, message: str, code: str) -> web.Response:
    body = {"error": {"message": message, "type": "invalid_request_error", "param": None, "code": code}}
    return web.json_response(body, status=status)


def error_body(error: GatewayError, prompt_param: str | None = None) -> dict[str, Any]:
    """`prompt_param`: the body field holding the prompt (messages, prompt, input), named by a prompt too long
    for the model's context."""
    if isinstance(error, PromptTooLong):
        return {
            "message": error.message,
            "type": "invalid_request_error",
            "param": prompt_param,
            "code": "context_length_exceeded",
        }
    _, kind = STATUS.get(error.kind, (500, "server_error"))
    first_word = error.message.split(" ", 1)[0].split(".", 1)[0].split("[", 1)[0]
    code = None
    if error.kind is ErrorKind.RESOURCE_EXHAUSTED:
        code = "insufficient_quota" if error.message.startswith("spend limit") else "rate_limit_exceeded"
    elif error.kind is ErrorKind.NOT_FOUND:
        code = "model_not_found"
    elif error.kind is ErrorKind.UNAUTHENTICATED:
        code = "invalid_api_key"
    param = first_word if first_word in PARAMS else None
    return {"message": error.message, "type": kind, "param": param, "code": code}


def error_response(error: GatewayError, prompt_param: str | None = None) -> web.Response:
    status, _ = STATUS.get(error.kind, (500, "server_error"))
    headers = dict(error.rate_limit_metadata)
    if error.retry_after_ms is not None:
        headers["Retry-After"] = str(max(1, math.ceil(error.retry_after_ms / 1000)))
        headers["retry-after-ms"] = str(error.retry_after_ms)
    return web.json_response({"error": error_body(error, prompt_param)}, status=status, headers=headers)


def execution_error(error: GatewayError, admitted: Admitted) -> web.Response:
    """The error that ended an execution, as its client is told it, named by its id."""
    response = error_response(as_told(error, admitted.execution_id))
    response.headers[REQUEST_ID_HEADER] = admitted.execution_id
    return response


def json_error(status: int, kind: str, message: str, param: str | None) -> web.Response:
    return web.json_response({"error": {"message": message, "type": kind, "param": param, "code": None}}, status=status)
