"""Every answer of the HTTP front carries `X-Request-Id`, as OpenAI's do: the execution's id where a request
ran, else an id of the answer's own; refusals, model lists, aiohttp's own errors and refused heads too."""

import json
import re

import pytest

from tests.gateway.harness import API_KEY, MODEL, in_process_gateway, raw_http

FRESH_ID = re.compile(r"req_[0-9a-f]{32}")
EXECUTION_ID = re.compile(r"exec_[0-9a-f]{32}")
AUTH = {"Authorization": f"Bearer {API_KEY}"}
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}


@pytest.fixture
async def gateway(tmp_path):
    async with in_process_gateway(tmp_path) as gateway:
        yield gateway


async def answer_id(gateway, method: str, url: str, headers: dict, body: dict | None = None) -> tuple[int, str]:
    async with gateway.http.request(method, url, headers=headers, json=body) as response:
        await response.read()
        return response.status, response.headers.get("X-Request-Id", "")


@pytest.mark.parametrize(
    ("method", "url", "headers", "body", "status"),
    [
        ("GET", "/v1/models", AUTH, None, 200),
        ("GET", f"/v1/models/{MODEL}", AUTH, None, 200),
        ("GET", "/health", {}, None, 200),
        ("GET", "/v1/models", {}, None, 401),
        ("GET", "/v1/models/nope", AUTH, None, 404),
        ("POST", "/v1/chat/completions", AUTH, {"messages": CHAT["messages"]}, 400),
        ("POST", "/v1/chat/completions", AUTH, {**CHAT, "model": "nope"}, 404),
        ("POST", "/v1/chat/completions", {}, CHAT, 401),
        ("GET", "/v1/embeddings", AUTH, None, 404),
        ("DELETE", "/v1/models", AUTH, None, 405),
    ],
)
async def test_an_answer_without_an_execution_has_an_id_of_its_own(gateway, method, url, headers, body, status):
    first = await answer_id(gateway, method, url, headers, body)
    second = await answer_id(gateway, method, url, headers, body)
    assert first[0] == second[0] == status
    assert FRESH_ID.fullmatch(first[1]) and FRESH_ID.fullmatch(second[1]) and first[1] != second[1]


async def test_an_execution_that_failed_is_named_by_its_id(gateway):
    """Past the door the harness's fleet has no workers: the execution ends UNAVAILABLE, under its own id."""
    status, request_id = await answer_id(gateway, "POST", "/v1/chat/completions", AUTH, CHAT)
    assert status == 503 and EXECUTION_ID.fullmatch(request_id), request_id
    async with gateway.http.post("/v1/chat/completions", headers=AUTH, json={**CHAT, "stream": True}) as response:
        assert response.status == 200 and EXECUTION_ID.fullmatch(response.headers["X-Request-Id"])
        raw = (await response.read()).decode()
    events = [json.loads(line.removeprefix("data: ")) for line in raw.split("\n\n") if line.startswith("data: {")]
    assert any("error" in event for event in events)


async def test_a_head_the_parser_refuses_has_an_id_too(gateway):
    head = b"GET /v1/models HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Trace: a\x01b\r\n"
    status_and_headers, _ = await raw_http(gateway, head)
    assert status_and_headers.startswith(b"HTTP/1.0 400 ")
    (line,) = [line for line in status_and_headers.split(b"\r\n") if line.lower().startswith(b"x-request-id:")]
    assert FRESH_ID.fullmatch(line.split(b":", 1)[1].strip().decode())
