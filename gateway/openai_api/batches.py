"""The Batch API at the gateway: `/v1/files` and `/v1/batches`, so that an OpenAI client with the gateway as
its one base URL uploads files and runs batches unchanged.

The control plane keeps files and batches (its public API, `/api/v1/files` and `/api/v1/batches`, in the same
shapes): each call is forwarded there with the caller's own `Authorization`, and the answer goes back as it
is. The gateway adds no credential of its own, so a caller reaches only its organization's files and
batches, exactly as on the control plane. The body is bounded and inflated as the
generating routes' are (`bodies.py`).

Only the operations below are forwarded, to a path built from the operation and an id of the control
plane's format (`file_` or `batch_` and base62, `controlplane/common/ids.py`), never from the client's
path; the query goes as parameters, encoded again, for the control plane to check. A path such as
`/v1/files/..%2Fapi-keys` would otherwise reach any control-plane endpoint with the caller's key.
"""

import logging
import re
from functools import partial

import httpx
from aiohttp import web

from gateway.bodies import BodyRefused, read_body

log = logging.getLogger(__name__)

ROUTES = (
    ("GET", "/v1/files"),
    ("POST", "/v1/files"),
    ("GET", "/v1/files/{file_id}"),
    ("DELETE", "/v1/files/{file_id}"),
    ("GET", "/v1/files/{file_id}/content"),
    ("GET", "/v1/batches"),
    ("POST", "/v1/batches"),
    ("GET", "/v1/batches/{batch_id}"),
    ("POST", "/v1/batches/{batch_id}/cancel"),
    # OpenAI's organization usage and costs, which the control plane answers from its ledger (admin:read keys).
    ("GET", "/v1/organization/usage/completions"),
    ("GET", "/v1/organization/costs"),
)
# The control plane's public ids: a prefix and base62, PUBLIC_ID_MAX_LENGTH (32) characters at most.
IDS = {
    "file_id": ("file", re.compile(r"file_[0-9A-Za-z]{1,27}")),
    "batch_id": ("batch", re.compile(r"batch_[0-9A-Za-z]{1,26}")),
}
FORWARDED_HEADERS = ("Authorization", "Content-Type", "Idempotency-Key")
RETURNED_HEADERS = ("Content-Type", "Idempotent-Replayed")
TIMEOUT_S = 60.0


class BatchApiProxy:
    def __init__(self, control_plane_url: str, timeout_s: float = TIMEOUT_S) -> None:
        self._http = httpx.AsyncClient(base_url=control_plane_url.rstrip("/") + "/api", timeout=timeout_s)

    def add_routes(self, app: web.Application) -> None:
        for method, path in ROUTES:
            app.router.add_route(method, path, partial(self.forward, path))

    async def forward(self, route_path: str, request: web.Request) -> web.Response:
        try:
            path = upstream_path(route_path, request)
        except UnknownId as error:
            return _error(404, "not_found_error", str(error), error.param)
        headers = {name: request.headers[name] for name in FORWARDED_HEADERS if name in request.headers}
        try:
            body = await read_body(request)  # forwarded inflated: Content-Encoding is not forwarded
        except BodyRefused as error:
            return _error(error.status, "invalid_request_error", error.message, None)
        try:
            answer = await self._http.request(
                request.method, path, params=list(request.query.items()), content=body, headers=headers
            )
        except httpx.TransportError as error:
            log.warning("could not forward %s %s to the control plane: %r", request.method, path, error)
            message = "files and batches are unavailable right now (control plane unreachable); retry shortly"
            return _error(503, "service_unavailable", message, None)
        returned = {name: answer.headers[name] for name in RETURNED_HEADERS if name in answer.headers}
        return web.Response(body=answer.content, status=answer.status_code, headers=returned)

    async def close(self) -> None:
        await self._http.aclose()


class UnknownId(Exception):
    def __init__(self, param: str, kind: str) -> None:
        super().__init__(f"{param} names no {kind}: a {kind} id is '{kind}_' followed by letters and digits")
        self.param = param


def upstream_path(route_path: str, request: web.Request) -> str:
    """The control plane's path of `route_path` (e.g. /v1/files/{file_id}/content), which `request` matched,
    each id in it checked against its format."""
    ids = {name: _checked_id(name, value) for name, value in request.match_info.items()}
    return route_path.format(**ids)


def _checked_id(param: str, value: str) -> str:
    kind, pattern = IDS[param]
    if not pattern.fullmatch(value):
        raise UnknownId(param, kind)
    return value


def _error(status: int, kind: str, message: str, param: str | None) -> web.Response:
    return web.json_response({"error": {"message": message, "type": kind, "param": param, "code": None}}, status=status)
