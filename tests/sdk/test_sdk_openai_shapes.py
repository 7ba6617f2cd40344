"""What openai-python offers beside the call itself: `model_dump()` / `to_json()`, `choices[i].message`,
`with_raw_response`, `extra_headers` / `extra_body`, auto-pagination; against the scripted loopback servers
(a real gRPC channel, a real HTTP socket)."""

from __future__ import annotations

import json
from datetime import UTC, datetime
from itertools import islice

import pytest
from sdk_scripted_http import Reply, ScriptedHttp
from sdk_scripted_server import final_usage, request_id_of, tokens

import diptych
from diptych_proto.v1 import inference_pb2 as pb

HELLO = tokens(("Hel", [1, 2]), ("lo", [3]))
LIMITS = (
    ("x-ratelimit-limit-requests", "10"),
    ("x-ratelimit-remaining-requests", "9"),
    ("x-ratelimit-reset-requests", "6s"),
)
USER = [{"role": "user", "content": "Hi"}]


def key(number: int) -> dict[str, object]:
    return {
        "id": f"key_{number}",
        "name": f"k{number}",
        "prefix": "dip_ab12",
        "scopes": ["inference"],
        "created_at": "2026-11-20T10:00:00Z",
        "last_used_at": None,
        "expires_at": None,
        "revoked_at": None,
    }


def file(number: int) -> dict[str, object]:
    return {"id": f"file_{number}", "bytes": 10, "created_at": 1_700_000_000, "filename": "a.jsonl", "purpose": "batch"}


def tool_call(request, context):
    yield pb.GenerateResponse(
        request_id=request_id_of(request),
        finish_reason=pb.FINISH_REASON_TOOL_CALLS,
        tool_calls=[pb.ToolCall(id="call_1", name="get_weather", arguments='{"city": "Oslo"}')],
        usage=final_usage(),
    )


@pytest.fixture
def client(server):
    with diptych.Client(api_key="sk-test", base_url=server.base_url, timeout=30, max_retries=0) as client:
        yield client


@pytest.fixture
def http():
    server = ScriptedHttp()
    yield server
    server.close()


@pytest.fixture
def admin(http):
    with diptych.Client(api_key="dip_admin", admin_url=http.url, timeout=5, max_retries=0) as client:
        yield client


# ---- model_dump() / to_dict() / to_json() -----------------------------------------------------------------


def test_a_completion_dumps_to_nested_dicts_and_json(server, client):
    server.servicer.script = [HELLO]
    completion = client.chat.completions.create(model="m", messages=USER)
    dumped = completion.model_dump()
    assert dumped == completion.to_dict()
    assert dumped["text"] == "Hello" and dumped["usage"]["prefill"]["worker_id"] == "prefill-0"
    assert dumped["choices"] == [
        {
            "index": 0,
            "text": "Hello",
            "token_ids": [1, 2, 3],
            "finish_reason": "stop",
            "logprobs": None,
            "tool_calls": None,
            "message": {"role": "assistant", "content": "Hello", "tool_calls": None},
        }
    ]
    assert json.loads(completion.to_json()) == dumped
    assert "logprobs" not in completion.model_dump(exclude_none=True)["choices"][0]


def test_admin_results_dump_times_as_iso_in_json_mode_and_pages_without_their_fetcher(http, admin):
    http.script = [Reply(body={"data": [key(1)], "has_more": False, "total": 1})]
    page = admin.admin.api_keys.list()
    assert page.to_dict()["data"][0]["created_at"] == datetime(2026, 11, 20, 10, tzinfo=UTC)
    assert page.to_dict(mode="json") == {
        "data": [{**key(1), "created_at": "2026-11-20T10:00:00+00:00", "key": None, "project_id": ""}],
        "has_more": False,
        "total": 1,
    }
    assert json.loads(page.to_json()) == page.model_dump(mode="json")


# ---- choices[i].message -----------------------------------------------------------------------------------


def test_chat_choices_carry_the_assistant_message_and_a_prompt_completion_none(server, client):
    server.servicer.script = [HELLO]
    chat = client.chat.completions.create(model="m", messages=USER)
    assert chat.choices[0].message == diptych.types.ChatCompletionMessage(role="assistant", content="Hello")
    assert chat.choices[0].message.content == chat.text
    assert client.completions.create(model="m", prompt="x").choices[0].message is None


def test_a_tool_call_answer_has_no_content_and_its_calls_on_the_message(server, client):
    server.servicer.script = [tool_call]
    chat = client.chat.completions.create(model="m", messages=USER)
    (choice,) = chat.choices
    assert choice.message is not None and choice.message.content is None
    assert (
        choice.message.tool_calls
        == choice.tool_calls
        == [diptych.types.ToolCall("call_1", diptych.types.FunctionCall("get_weather", '{"city": "Oslo"}'))]
    )


async def test_async_chat_choices_carry_the_message(server):
    server.servicer.script = [HELLO]
    async with diptych.AsyncClient(api_key="sk-test", base_url=server.base_url, max_retries=0) as client:
        chat = await client.chat.completions.create(model="m", messages=USER)
    assert chat.choices[0].message is not None and chat.choices[0].message.content == "Hello"


# ---- with_raw_response ------------------------------------------------------------------------------------


def test_raw_chat_response_has_the_gateways_metadata_and_parses_to_the_completion(server, client):
    server.servicer.script = [tokens(("Hello", [1]), initial_metadata=LIMITS)]
    raw = client.chat.completions.with_raw_response.create(model="m", messages=USER)
    completion = raw.parse()
    assert isinstance(completion, diptych.Completion) and completion.text == "Hello"
    assert raw.request_id == raw.headers["request-id"] == completion.id == request_id_of(server.servicer.requests[0])
    assert raw.headers["x-ratelimit-limit-requests"] == "10"
    assert raw.rate_limits == diptych.RateLimitStatus(limit_requests=10, remaining_requests=9, reset_requests=6.0)


def test_raw_stream_response_parses_to_the_stream(server, client):
    server.servicer.script = [tokens(("Hel", [1]), ("lo", [2]), initial_metadata=LIMITS)]
    raw = client.completions.with_raw_response.create(model="m", prompt="x", stream=True)
    with raw.parse() as stream:
        assert "".join(chunk.text for chunk in stream) == "Hello"
    assert raw.request_id == stream.request_id and raw.rate_limits == stream.rate_limits


def test_raw_models_list(server, client):
    server.servicer.models = [pb.Model(id="m", context_length=8, has_chat_template=True)]
    server.servicer.models_metadata = (("request-id", "req_models"), *LIMITS)
    raw = client.models.with_raw_response.list()
    assert [model.id for model in raw.parse()] == ["m"]
    assert raw.request_id == "req_models" and raw.rate_limits is not None and raw.rate_limits.limit_requests == 10


async def test_async_raw_responses(server, http):
    server.servicer.script = [tokens(("Hello", [1]), initial_metadata=LIMITS)]
    http.script = [Reply(body={"limit_micros": 7}, headers={"X-Request-Id": "req_spend"})]
    async with diptych.AsyncClient(api_key="k", base_url=server.base_url, admin_url=http.url) as client:
        raw = await client.completions.with_raw_response.create(model="m", prompt="x")
        spend = await client.admin.spend_limit.with_raw_response.retrieve()
    assert raw.request_id == raw.parse().id and raw.rate_limits is not None
    assert spend.request_id == "req_spend" and spend.parse() == diptych.SpendLimit(limit_micros=7)


def test_raw_admin_response_has_the_http_headers(http, admin):
    headers = {"X-Request-Id": "req_http_1", "X-RateLimit-Limit-Requests": "5"}
    http.script = [Reply(body={"data": [key(1)], "has_more": False, "total": 1}, headers=headers)]
    raw = admin.admin.api_keys.with_raw_response.list(limit=1)
    assert raw.headers["content-type"] == "application/json" and raw.request_id == "req_http_1"
    assert raw.rate_limits == diptych.RateLimitStatus(limit_requests=5)
    assert [item.id for item in raw.parse().data] == ["key_1"]


# ---- extra_headers / extra_body ---------------------------------------------------------------------------


def test_extra_headers_travel_as_metadata(server, client):
    server.servicer.script = [HELLO]
    client.completions.create(model="m", prompt="x", extra_headers={"X-Trace-Id": "t-1"})
    client.chat.completions.create(model="m", messages=USER, extra_headers={"authorization": "Bearer other"})
    first, second = server.servicer.metadata
    assert first["x-trace-id"] == "t-1" and first["authorization"] == "Bearer sk-test"
    assert second["authorization"] == "Bearer other"


@pytest.mark.parametrize("headers", [{"bad name": "x"}, {"grpc-timeout": "1S"}, {"x-a": "line\nbreak"}, {"x-b": 1}])
def test_headers_grpc_cannot_carry_are_refused_before_sending(server, client, headers):
    with pytest.raises(ValueError, match="extra_headers"):
        client.completions.create(model="m", prompt="x", extra_headers=headers)
    assert server.servicer.requests == []


def test_extra_body_sets_contract_fields_over_the_arguments(server, client):
    server.servicer.script = [HELLO]
    client.completions.create(model="m", prompt="x", max_tokens=10, extra_body={"max_tokens": 3, "top_k": 5})
    (request,) = server.servicer.requests
    assert (request.max_tokens, request.top_k) == (3, 5)


@pytest.mark.parametrize("body", [{"reasoning_effort": "high"}, {"max_tokens": "many"}])
def test_extra_body_the_contract_cannot_carry_is_refused_before_sending(server, client, body):
    with pytest.raises(ValueError, match="extra_body") as refused:
        client.chat.completions.create(model="m", messages=USER, extra_body=body)
    assert next(iter(body)) in str(refused.value)
    assert server.servicer.requests == []


async def test_async_extra_headers_and_body(server):
    server.servicer.script = [HELLO]
    async with diptych.AsyncClient(api_key="k", base_url=server.base_url) as client:
        await client.chat.completions.create(
            model="m", messages=USER, extra_headers={"x-trace-id": "t-2"}, extra_body={"seed": 9}
        )
        with pytest.raises(ValueError, match="nope"):
            await client.completions.create(model="m", prompt="x", extra_body={"nope": 1})
    assert server.servicer.metadata[0]["x-trace-id"] == "t-2" and server.servicer.requests[0].seed == 9
    assert len(server.servicer.requests) == 1


# ---- auto-pagination --------------------------------------------------------------------------------------


def test_iterating_an_offset_page_walks_every_page(http, admin):
    http.script = [
        Reply(body={"data": [key(1), key(2)], "has_more": True, "total": 3}),
        Reply(body={"data": [key(3)], "has_more": False, "total": 3}),
    ]
    page = admin.admin.api_keys.list(limit=2)
    assert [item.id for item in page] == ["key_1", "key_2", "key_3"]
    assert [seen.path for seen in http.seen] == ["/api/v1/api-keys?limit=2", "/api/v1/api-keys?limit=2&offset=2"]
    assert page.has_next_page() and not page.get_next_page().has_next_page()


def test_iterating_a_cursor_page_walks_every_page(http, admin):
    http.script = [
        Reply(body={"data": [file(1), file(2)], "has_more": True, "last_id": "file_2"}),
        Reply(body={"data": [file(3)], "has_more": False, "last_id": "file_3"}),
    ]
    pages = list(admin.files.list(limit=2, purpose="batch").iter_pages())
    assert [[item.id for item in page.data] for page in pages] == [["file_1", "file_2"], ["file_3"]]
    assert http.seen[1].path == "/api/v1/files?purpose=batch&limit=2&after=file_2"


def test_an_empty_page_that_claims_more_ends_the_walk(http, admin):
    http.script = [Reply(body={"data": [], "has_more": True, "last_id": None})]
    page = admin.batches.list()
    assert not page.has_next_page() and list(islice(page.iter_pages(), 3)) == [page] and len(http.seen) == 1
    assert list(page) == []
    with pytest.raises(RuntimeError, match="has_next_page"):
        page.get_next_page()


async def test_async_pages_walk_with_async_for(http):
    http.script = [
        Reply(body={"data": [key(1)], "has_more": True, "total": 2}),
        Reply(body={"data": [key(2)], "has_more": False, "total": 2}),
        Reply(body={"data": [file(1)], "has_more": True, "last_id": "file_1"}),
        Reply(body={"data": [file(2)], "has_more": False, "last_id": "file_2"}),
    ]
    async with diptych.AsyncClient(api_key="k", admin_url=http.url) as client:
        keys = [item.id async for item in await client.admin.api_keys.list(limit=1)]
        files = [item.id async for item in await client.files.list(limit=1)]
    assert (keys, files) == (["key_1", "key_2"], ["file_1", "file_2"])
    assert [seen.path for seen in http.seen][1::2] == [
        "/api/v1/api-keys?limit=1&offset=1",
        "/api/v1/files?limit=1&after=file_1",
    ]
