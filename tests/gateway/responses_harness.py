"""A whole gateway in process for the Responses API, over workers of the built-in tiny model served in this
process: the pipeline, the HTTP app (with /v1/responses) and the request path are the real ones, and so is
the gateway's client of stored responses (`ResponseStore`); the control plane answers from memory: two keys
of two organizations, the tiny model, idempotency keys, and stored responses kept as the control plane keeps
them (tests/platform/test_responses_store.py checks the control plane itself)."""

import copy
from contextlib import asynccontextmanager
from dataclasses import dataclass

import httpx
from aiohttp.test_utils import TestClient

from diptych_common.worker_credential import WorkerSecret
from gateway.accounts.auth import Authenticator
from gateway.accounts.idempotency import IdempotencyKeys
from gateway.accounts.limits import RateLimiter
from gateway.accounts.usage import UsageJournal
from gateway.core.pipeline import Pipeline
from gateway.fleet.channels import Channels
from gateway.fleet.registry import Registry
from gateway.openai_api.app import build_app
from gateway.openai_api.responses_store import ResponseStore
from gateway.routing.route import ServingMode
from tests.gateway.harness import API_KEY, MODEL, ControlPlaneInMemory, CountingRequestPath, GatewayTestServer
from tests.workers.conftest import wait_until
from tests.workers.serving import SECRET, Worker
from workers.serving.server import Role

OTHER_API_KEY = "dip_other_org_key"
ACTIVE = ("queued", "in_progress")


class ControlPlaneKeepingResponses(ControlPlaneInMemory):
    """Keys of two organizations, idempotency keys' answers, and stored responses by id."""

    def __init__(self, workers: list[dict]) -> None:
        super().__init__(workers=workers)
        self.responses: dict[str, dict] = {}  # id -> the wire body, as stored
        self.results: dict[str, dict] = {}
        self.stores: list[dict] = []  # every store call's body

    async def verify_api_key(self, api_key: str) -> dict | None:
        if api_key == OTHER_API_KEY:
            return {"api_key_id": "key_2", "organization_id": "org_2"}
        return await super().verify_api_key(api_key)

    async def claim_idempotency_key(self, body: dict) -> dict:
        stored = self.results.get(body["key"])
        return {"outcome": "claimed"} if stored is None else {"outcome": "completed", "response": stored}

    async def complete_idempotency_key(self, body: dict) -> dict:
        self.results[body["key"]] = body["response"]
        return {}

    async def release_idempotency_key(self, body: dict) -> dict:
        return {}

    async def store_response(self, body: dict) -> dict:
        self.stores.append(copy.deepcopy(body))
        body = {key: value for key, value in body.items() if key != "create"}
        stored = self.responses.get(body["id"])
        if stored is None and not self.stores[-1]["create"]:
            return {"id": body["id"], "status": None}
        if stored is not None and (
            stored["status"] == "cancelled" or (stored["status"] not in ACTIVE and body["status"] in ACTIVE)
        ):
            body["status"] = stored["status"]
        self.responses[body["id"]] = body
        return {"id": body["id"], "status": body["status"]}

    def _owned(self, organization_id: str, response_id: str) -> dict | None:
        stored = self.responses.get(response_id)
        return stored if stored is not None and stored["organization_id"] == organization_id else None

    async def fetch_response(self, organization_id: str, response_id: str) -> dict | None:
        return copy.deepcopy(self._owned(organization_id, response_id))

    async def response_status(self, organization_id: str, response_id: str) -> str | None:
        stored = self._owned(organization_id, response_id)
        return None if stored is None else stored["status"]

    async def delete_response(self, organization_id: str, response_id: str) -> bool:
        return self._owned(organization_id, response_id) is not None and bool(self.responses.pop(response_id))

    async def cancel_response(self, organization_id: str, response_id: str) -> dict | None:
        stored = self._owned(organization_id, response_id)
        if stored is None or stored["status"] == "cancelled":
            return copy.deepcopy(stored)
        if not stored["background"] or stored["status"] not in ACTIVE:
            refusal = f"Response {response_id} is {stored['status']}; only a background one running can be cancelled."
            raise _refused(refusal)
        stored["status"] = "cancelled"
        return copy.deepcopy(stored)

    async def response_input_items(self, organization_id: str, response_id: str, query) -> dict | None:
        stored = self._owned(organization_id, response_id)
        if stored is None:
            return None
        items = list(reversed(stored["input_items"]))
        return {
            "object": "list",
            "data": items,
            "first_id": items[0]["id"],
            "last_id": items[-1]["id"],
            "has_more": False,
        }


def _refused(message: str) -> httpx.HTTPStatusError:
    """A 400 as the control plane's client raises it."""
    request = httpx.Request("POST", "http://control-plane/api/v1/internal/responses")
    answer = httpx.Response(400, json={"error": {"type": "validation_error", "message": message}}, request=request)
    return httpx.HTTPStatusError(message, request=request, response=answer)


@dataclass
class ResponsesGateway:
    http: TestClient
    path: CountingRequestPath
    control_plane: ControlPlaneKeepingResponses
    journal: UsageJournal
    workers: dict[str, Worker]

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.http.server.port}/v1"


@asynccontextmanager
async def responses_gateway(tmp_path, tiny_model, executor, roles: dict[str, Role], mode: ServingMode, grammars=None):
    workers = {
        name: Worker(role, tiny_model, executor, allow_shm=False, grammars=grammars) for name, role in roles.items()
    }
    for worker in workers.values():
        await worker.start()
    entries = [
        {
            "id": name,
            "role": str(roles[name]),
            "model": MODEL,
            "region": "local",
            "address": w.address,
            "state": "ready",
        }
        for name, w in workers.items()
    ]
    control_plane = ControlPlaneKeepingResponses(entries)
    channels = Channels(WorkerSecret(SECRET))
    registry = Registry(control_plane)
    await registry.refresh()
    path = CountingRequestPath(registry, channels, mode)
    journal = UsageJournal(tmp_path / "usage-journal.sqlite3")
    pipeline = Pipeline(
        Authenticator(control_plane), registry, RateLimiter(), path, journal, IdempotencyKeys(control_plane, journal)
    )
    http = TestClient(GatewayTestServer(build_app(pipeline, None, ResponseStore(control_plane))))
    await http.start_server()
    try:
        assert await wait_until(lambda: all(path.board.is_fresh(name) for name in workers), timeout=10)
        yield ResponsesGateway(http, path, control_plane, journal, workers)
    finally:
        await http.close()
        path.board.close()
        journal.close()
        await channels.close()
        for worker in workers.values():
            await worker.stop()


def headers(api_key: str = API_KEY) -> dict[str, str]:
    return {"Authorization": f"Bearer {api_key}"}
