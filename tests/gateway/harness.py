"""A whole gateway in process, without a control plane or workers: the pipeline, the HTTP app and the gRPC
service are the real ones; the control plane answers from memory (one key, the built-in tiny model) and
the fleet has no workers, so a request that passes every check at the door ends in UNAVAILABLE. Enough
for everything that is decided before a request reaches a worker: parsing, validation, tokenization,
error shapes."""

import asyncio
import json
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path

import grpc
from aiohttp.test_utils import TestClient, TestServer

from gateway.accounts.auth import Authenticator
from gateway.accounts.idempotency import IdempotencyKeys
from gateway.accounts.limits import RateLimiter
from gateway.accounts.usage import UsageJournal
from gateway.core.pipeline import Pipeline
from gateway.core.request_path import RequestPath
from gateway.fleet.channels import Channels
from gateway.fleet.live_load import LoadBoard
from gateway.fleet.registry import Registry
from gateway.grpc_api.service import add_inference_service
from gateway.openai_api.app import build_app
from gateway.openai_api.batches import BatchApiProxy
from gateway.openai_api.server import JsonErrorAppRunner
from gateway.routing.route import ServingMode
from gateway.routing.router import Router

API_KEY = "dip_test_key"
MODEL = "diptych-tiny"
CONTEXT_LENGTH = 1024
MODEL_CREATED_AT = "2026-01-02T03:04:05.678901Z"  # when the catalog added MODEL
GENERATE_METHOD = "/diptych.v1.Inference/Generate"


class ControlPlaneInMemory:
    """The control plane's answers to the gateway: one valid key and one model, no workers unless given
    (registry entries of workers served in the test). `identity`: more of the key's answer (its limits,
    scopes, spend)."""

    def __init__(self, identity: dict | None = None, workers: list[dict] | None = None) -> None:
        self.identity = {"api_key_id": "key_1", "organization_id": "org_1", **(identity or {})}
        self.workers = list(workers or [])
        self.usage_headers: list[dict[str, str]] = []  # the headers of each usage POST (a traceparent)

    async def verify_api_key(self, api_key: str) -> dict | None:
        if api_key != API_KEY:
            return None
        return self.identity

    async def registry(self) -> dict:
        return {
            "models": [
                {
                    "name": MODEL,
                    "source": f"builtin:{MODEL}",
                    "context_length": CONTEXT_LENGTH,
                    "created_at": MODEL_CREATED_AT,
                }
            ],
            "workers": list(self.workers),
        }

    async def post_usage_events(self, events: list[dict], headers: dict[str, str] | None = None) -> dict:
        self.usage_headers.append(dict(headers or {}))
        return {"accepted": len(events)}


class CountingRequestPath(RequestPath):
    """The real request path, counting the requests that reached it. Over a fleet with no workers a
    request that passed every check at the door gets UNAVAILABLE ("no ready ... workers"); the workers
    the registry lists are watched over `channels` (which carry their RPC secret) and served in `mode`."""

    def __init__(
        self, registry: Registry, channels: Channels | None = None, mode: ServingMode = ServingMode.AUTO
    ) -> None:
        channels = channels or Channels()
        self.board = LoadBoard(channels)
        self.board.sync(registry.workers)
        super().__init__(channels, self.board, Router(registry, self.board, mode))
        self.runs = 0

    async def run(self, plan, trace):
        self.runs += 1
        async for event in super().run(plan, trace):
            yield event


class GatewayTestServer(TestServer):
    """aiohttp's test server, on the runner the gateway serves its HTTP front with."""

    async def _make_runner(self, **kwargs) -> JsonErrorAppRunner:
        return JsonErrorAppRunner(self.app, **kwargs)


@dataclass
class InProcessGateway:
    pipeline: Pipeline
    path: CountingRequestPath
    http: TestClient
    channel: grpc.aio.Channel
    grpc_target: str  # for another channel of one's own
    journal: UsageJournal  # the usage spool: a UsageReporter over it sends its events to `control_plane`
    control_plane: ControlPlaneInMemory


@asynccontextmanager
async def in_process_gateway(
    state_dir: Path,
    control_plane: ControlPlaneInMemory | None = None,
    limiter: RateLimiter | None = None,
    channels: Channels | None = None,
    mode: ServingMode = ServingMode.AUTO,
    batch_api: BatchApiProxy | None = None,
):
    """`batch_api`: the files and batches proxy, to a control plane of the test's own."""
    control_plane = control_plane or ControlPlaneInMemory()
    registry = Registry(control_plane)
    await registry.refresh()
    path = CountingRequestPath(registry, channels, mode)
    journal = UsageJournal(state_dir / "usage-journal.sqlite3")
    pipeline = Pipeline(
        Authenticator(control_plane),
        registry,
        limiter or RateLimiter(),
        path,
        journal,
        IdempotencyKeys(control_plane, journal),
    )
    server = grpc.aio.server()
    add_inference_service(server, pipeline)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    http = TestClient(GatewayTestServer(build_app(pipeline, batch_api)))
    await http.start_server()
    target = f"127.0.0.1:{port}"
    channel = grpc.aio.insecure_channel(target)
    try:
        yield InProcessGateway(pipeline, path, http, channel, target, journal, control_plane)
    finally:
        await channel.close()
        await http.close()
        await server.stop(None)
        path.board.close()
        journal.close()


async def post_json(gateway: InProcessGateway, url: str, body: bytes, headers: dict | None = None):
    """Status and parsed JSON answer of one POST (None when the answer is not JSON)."""
    headers = {"Authorization": f"Bearer {API_KEY}", "Content-Type": "application/json", **(headers or {})}
    async with gateway.http.post(url, data=body, headers=headers) as response:
        raw = await response.read()
    try:
        return response.status, json.loads(raw)
    except ValueError:
        return response.status, None


async def raw_http(gateway: InProcessGateway, head: bytes, body: bytes = b"") -> tuple[bytes, bytes]:
    """Status line with headers, and body, of the answer to `head` (a request line and headers, without the
    blank line) and `body`, sent byte for byte: HTTP clients normalize or refuse the paths and headers sent
    this way."""
    reader, writer = await asyncio.open_connection("127.0.0.1", gateway.http.server.port)
    try:
        writer.write(head + b"Connection: close\r\n\r\n" + body)
        answer = await asyncio.wait_for(reader.read(), 30)
    finally:
        writer.close()
    status_and_headers, _, body = answer.partition(b"\r\n\r\n")
    return status_and_headers, body


async def generate_raw(gateway: InProcessGateway, payload: bytes, timeout: float = 10.0) -> grpc.StatusCode:
    """Sends raw bytes as a Generate request; the status the stream ends with."""
    call = gateway.channel.unary_stream(GENERATE_METHOD)(
        payload, metadata=(("authorization", f"Bearer {API_KEY}"),), timeout=timeout
    )
    try:
        async for _ in call:
            pass
    except grpc.aio.AioRpcError as error:
        return error.code()
    return await call.code()


def assert_openai_error_shape(payload) -> None:
    assert isinstance(payload, dict) and set(payload) == {"error"}, payload
    error = payload["error"]
    assert set(error) == {"message", "type", "param", "code"}, error
    assert isinstance(error["message"], str) and error["message"]
