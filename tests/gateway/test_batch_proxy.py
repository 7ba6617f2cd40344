"""The gateway's files and batches proxy against the real control plane (a live Django server): it forwards
the operations it serves, to paths built from ids of the control plane's format, and nothing else. A path
whose id decodes to another path (`..%2F`), a fragment (`%23`) or a NUL gets a JSON 404 and reaches nothing."""

import asyncio
import gzip
import json
from contextlib import contextmanager

import aiohttp
import httpx
import pytest

from controlplane.tenancy.models import ApiKey, Organization
from controlplane.tenancy.services import api_key_create
from gateway.openai_api.batches import BatchApiProxy
from tests.gateway.harness import assert_openai_error_shape, in_process_gateway

ALL_SCOPES = ["inference", "admin:read", "admin:write"]
STEERING_PATHS = [  # (method, path, the id parameter at fault)
    ("GET", "/v1/files/..%2F..%2Fv1%2Fapi-keys", "file_id"),
    ("GET", "/v1/files/..%2F..%2Fv1%2Fapi-keys/content", "file_id"),
    ("DELETE", "/v1/files/..%2F..%2Fv1%2Fmembers%2Fusr_1", "file_id"),
    ("GET", "/v1/files/%00", "file_id"),
    ("GET", "/v1/files/file_abc%3Fpurpose=x", "file_id"),
    ("GET", "/v1/batches/..%2F..%2Fv1%2Fapi-keys", "batch_id"),
    ("POST", "/v1/batches/..%2F..%2Fv1%2Fapi-keys%23/cancel", "batch_id"),
    ("POST", "/v1/batches/batch_1%2F..%2F..%2F..%2Fv1%2Fapi-keys%23/cancel", "batch_id"),
]


@pytest.fixture
def organization(transactional_db) -> Organization:
    return Organization.objects.create(name="Acme", slug="acme")


@pytest.fixture
def api_key(organization) -> str:
    return api_key_create(organization=organization, name="owner", scopes=ALL_SCOPES).key


@contextmanager
def gateway_before(live_server, tmp_path):
    """An in-process gateway whose files and batches go to the live control plane; its event loop runs
    only inside `runner.run`, so the test's own database queries run beside it."""
    with asyncio.Runner() as runner:
        proxy = BatchApiProxy(live_server.url)
        context = in_process_gateway(tmp_path, batch_api=proxy)
        gateway = runner.run(context.__aenter__())
        try:
            yield runner, gateway
        finally:
            runner.run(context.__aexit__(None, None, None))
            runner.run(proxy.close())


async def call(gateway, method: str, path: str, api_key: str, **kwargs) -> tuple[int, bytes]:
    headers = {"Authorization": f"Bearer {api_key}", **kwargs.pop("headers", {})}
    async with gateway.http.request(method, path, headers=headers, **kwargs) as response:
        return response.status, await response.read()


@pytest.mark.parametrize(("method", "path", "param"), STEERING_PATHS)
def test_an_id_that_is_not_an_id_reaches_nothing(live_server, tmp_path, organization, api_key, method, path, param):
    body = json.dumps({"name": "stolen", "scopes": ALL_SCOPES}).encode()
    with gateway_before(live_server, tmp_path) as (runner, gateway):
        status, raw = runner.run(
            call(gateway, method, path, api_key, data=body, headers={"Content-Type": "application/json"})
        )
    assert status == 404, raw
    payload = json.loads(raw)
    assert_openai_error_shape(payload)
    assert payload["error"]["type"] == "not_found_error" and payload["error"]["param"] == param
    assert f"{param} names no" in payload["error"]["message"]
    assert list(ApiKey.objects.filter(organization=organization).values_list("name", flat=True)) == ["owner"]


def test_the_operations_it_serves_still_reach_the_control_plane(live_server, tmp_path, api_key):
    line = {"custom_id": "a", "method": "POST", "url": "/v1/chat/completions", "body": {"model": "m"}}
    with gateway_before(live_server, tmp_path) as (runner, gateway):

        async def upload_then_read() -> tuple:
            form = aiohttp.FormData({"purpose": "batch"})
            form.add_field("file", json.dumps(line).encode(), filename="lines.jsonl")
            status, raw = await call(gateway, "POST", "/v1/files", api_key, data=form)
            assert status == 200, raw
            file_id = json.loads(raw)["id"]
            listed = await call(gateway, "GET", "/v1/files?purpose=batch&limit=1", api_key)
            unknown = await call(gateway, "GET", "/v1/files?after=%2F..%2Fapi-keys%23&x=1", api_key)
            content = await call(gateway, "GET", f"/v1/files/{file_id}/content", api_key)
            missing = await call(gateway, "GET", "/v1/batches/batch_doesNotExist1", api_key)
            return file_id, listed, unknown, content, missing

        file_id, listed, unknown, content, missing = runner.run(upload_then_read())
    assert listed[0] == 200 and [f["id"] for f in json.loads(listed[1])["data"]] == [file_id]
    assert unknown[0] == 400 and b"Unknown query parameter x" in unknown[1]  # the control plane's own check
    assert content == (200, json.dumps(line).encode())
    assert missing[0] == 404  # well formed, but the control plane has no such batch


def test_a_compressed_upload_reaches_the_control_plane_inflated(live_server, tmp_path, api_key):
    """The gateway inflates the body and forwards it without its Content-Encoding."""
    line = {"custom_id": "z", "method": "POST", "url": "/v1/chat/completions", "body": {"model": "m"}}
    form = httpx.Request(
        "POST", live_server.url, data={"purpose": "batch"}, files={"file": ("lines.jsonl", json.dumps(line).encode())}
    )
    headers = {"Content-Type": form.headers["Content-Type"], "Content-Encoding": "gzip"}
    body = gzip.compress(form.read())
    with gateway_before(live_server, tmp_path) as (runner, gateway):

        async def upload_then_read() -> tuple:
            status, raw = await call(gateway, "POST", "/v1/files", api_key, data=body, headers=headers)
            assert status == 200, raw
            return await call(gateway, "GET", f"/v1/files/{json.loads(raw)['id']}/content", api_key)

        content = runner.run(upload_then_read())
    assert content == (200, json.dumps(line).encode())
