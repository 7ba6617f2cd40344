"""The Batch API at the gateway: `/v1/files` and `/v1/batches`, so that an OpenAI client with the gateway as
its one base URL uploads files and runs batches unchanged.

The control plane keeps files and batches (its public API, `/api/v1/files` and `/api/v1/batches`, in the same
shapes): each call is forwarded there as it came, with the caller's own `Authorization`, and the answer goes
back as it is. The gateway adds no credential of its own, so a caller reaches only its organization's
files and batches, exactly as on the control plane. The body is bounded by the HTTP app's client_max_size.
"""

import logging

import httpx
from aiohttp import web

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
)
FORWARDED_HEADERS = ("Authorization", "Content-Type", "Idempotency-Key")
RETURNED_HEADERS = ("Content-Type", "Idempotent-Replayed")
TIMEOUT_S = 60.0


class BatchApiProxy:
    def __init__(self, control_plane_url: str, timeout_s: float = TIMEOUT_S) -> None:
        self._http = httpx.AsyncClient(base_url=control_plane_url.rstrip("/") + "/api", timeout=timeout_s)

    def add_routes(self, app: web.Application) -> None:
        for method, path in ROUTES:
            app.router.add_route(method, path, self.forward)

    async def forward(self, request: web.Request) -> web.Response:
        headers = {name: request.headers[name] for name in FORWARDED_HEADERS if name in request.headers}
        body = await request.read()
        try:
            answer = await self._http.request(request.method, request.rel_url.path_qs, content=body, headers=headers)
        except httpx.TransportError as error:
            log.warning("could not forward %s %s to the control plane: %r", request.method, request.path, error)
            message = "files and batches are unavailable right now (control plane unreachable); retry shortly"
            return web.json_response(
                {"error": {"message": message, "type": "service_unavailable", "param": None, "code": None}}, status=503
            )
        returned = {name: answer.headers[name] for name in RETURNED_HEADERS if name in answer.headers}
        return web.Response(body=answer.content, status=answer.status_code, headers=returned)

    async def close(self) -> None:
        await self._http.aclose()
