"""The internal API's client over the gateway's transport (`AiohttpTransport`) behaves as over httpx's own:
the same answers, the same errors for a refusal (4xx), a failure (5xx), a control plane that is down or
too slow, a compressed answer decoded, and one connection kept for calls in a row. Against a real HTTP
server in the test's process."""

import asyncio
import gzip
import json
import socket

import httpx
import pytest
from aiohttp import web

from diptych_common.internal_api.client import ControlPlaneClient, ControlPlaneUnavailable
from gateway.accounts.control_plane_http import AiohttpTransport

TOKEN = "internal-token"


class InternalApi:
    """A few of the internal API's endpoints, answering as told; it records each call's headers and body."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, dict[str, str], bytes]] = []
        self.connections: set[object] = set()
        self.claim_status = 200
        self.delay_s = 0.0

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_post("/api/v1/internal/idempotency-keys/claim", self.claim)
        app.router.add_post("/api/v1/internal/api-keys/verify", self.verify)
        app.router.add_get("/api/v1/internal/registry", self.registry)
        return app

    def _record(self, request: web.Request, body: bytes) -> None:
        self.calls.append((request.path, dict(request.headers), body))
        self.connections.add(request.transport)

    async def claim(self, request: web.Request) -> web.Response:
        body = await request.read()
        self._record(request, body)
        await asyncio.sleep(self.delay_s)
        if self.claim_status != 200:
            return web.json_response({"detail": "no"}, status=self.claim_status)
        return web.json_response({"outcome": "claimed", "key": json.loads(body)["key"]})

    async def verify(self, request: web.Request) -> web.Response:
        self._record(request, await request.read())
        return web.json_response({"detail": "unknown key"}, status=401)

    async def registry(self, request: web.Request) -> web.Response:
        self._record(request, b"")
        payload = gzip.compress(json.dumps({"models": [], "workers": [{"id": "w" * 2000}]}).encode())
        return web.Response(body=payload, headers={"Content-Encoding": "gzip", "Content-Type": "application/json"})


@pytest.fixture
async def internal_api():
    api = InternalApi()
    runner = web.AppRunner(api.app())
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = runner.addresses[0][1]
    yield api, f"http://127.0.0.1:{port}"
    await runner.cleanup()


def client(url: str, timeout: float = 5.0) -> ControlPlaneClient:
    return ControlPlaneClient(url, TOKEN, timeout=timeout, transport=AiohttpTransport())


async def test_a_call_carries_the_token_and_body_and_gets_the_answer(internal_api):
    api, url = internal_api
    async with client(url) as control_plane:
        answer = await control_plane.claim_idempotency_key({"key": "k1", "execution_id": "exec_1"})
    assert answer == {"outcome": "claimed", "key": "k1"}
    [(path, headers, body)] = api.calls
    assert path == "/api/v1/internal/idempotency-keys/claim"
    assert headers["Authorization"] == f"Bearer {TOKEN}"
    assert headers["Content-Type"] == "application/json"
    assert json.loads(body) == {"key": "k1", "execution_id": "exec_1"}
    assert int(headers["Content-Length"]) == len(body)


async def test_refusals_and_failures_raise_as_the_client_says(internal_api):
    api, url = internal_api
    async with client(url) as control_plane:
        assert await control_plane.verify_api_key("dip_unknown") is None  # 401: a refused key
        api.claim_status = 409
        with pytest.raises(httpx.HTTPStatusError) as refused:
            await control_plane.claim_idempotency_key({"key": "k1"})
        assert refused.value.response.status_code == 409
        api.claim_status = 503
        with pytest.raises(ControlPlaneUnavailable, match="503"):
            await control_plane.claim_idempotency_key({"key": "k1"})


async def test_a_control_plane_that_is_down_or_too_slow_is_unavailable(internal_api):
    api, url = internal_api
    with socket.socket() as unused:
        unused.bind(("127.0.0.1", 0))
        closed_url = f"http://127.0.0.1:{unused.getsockname()[1]}"
    async with client(closed_url) as control_plane:
        with pytest.raises(ControlPlaneUnavailable) as down:
            await control_plane.claim_idempotency_key({"key": "k1"})
    assert isinstance(down.value.__cause__, httpx.ConnectError)
    api.delay_s = 1.0
    async with client(url, timeout=0.2) as control_plane:
        with pytest.raises(ControlPlaneUnavailable) as slow:
            await control_plane.claim_idempotency_key({"key": "k1"})
    assert isinstance(slow.value.__cause__, httpx.ReadTimeout)


async def test_a_compressed_answer_is_decoded(internal_api):
    _, url = internal_api
    async with client(url) as control_plane:
        registry = await control_plane.registry()
    assert registry == {"models": [], "workers": [{"id": "w" * 2000}]}


async def test_calls_in_a_row_share_one_connection(internal_api):
    api, url = internal_api
    async with client(url) as control_plane:
        for index in range(20):
            await control_plane.claim_idempotency_key({"key": f"k{index}"})
    assert len(api.calls) == 20 and len(api.connections) == 1
