"""`with_streaming_response` and the per-call options (`timeout`, `extra_headers`, `extra_query`, `extra_body`,
`idempotency_key`) of the HTTP-backed resources, against the scripted loopback HTTP server (a real socket);
and `with_streaming_response` of the gRPC resources, against the scripted gRPC server."""

from __future__ import annotations

import time

import pytest
from sdk_scripted_http import Reply, ScriptedHttp
from sdk_scripted_server import request_id_of, tokens

import diptych

KEY = {
    "id": "key_1",
    "name": "ci",
    "prefix": "dip_ab12",
    "scopes": ["inference"],
    "created_at": "2026-11-20T10:00:00Z",
    "last_used_at": None,
    "expires_at": None,
    "revoked_at": None,
}
LINES = b'{"custom_id": "a"}\n{"custom_id": "b"}\r\n{"custom_id": "c"}'
USER = [{"role": "user", "content": "Hi"}]
LIMITS = (("x-ratelimit-limit-requests", "10"), ("x-ratelimit-remaining-requests", "9"))


@pytest.fixture
def http():
    server = ScriptedHttp()
    yield server
    server.close()


@pytest.fixture
def admin(http):
    with diptych.Client(api_key="dip_admin", admin_url=http.url, timeout=5, max_retries=0) as client:
        yield client


# ---- with_streaming_response over HTTP -------------------------------------------------------------------


def test_the_response_comes_with_its_headers_and_status_before_its_body_is_read(http, admin):
    http.script = [Reply(body=KEY, headers={"X-Request-Id": "req_1", "X-RateLimit-Limit-Requests": "5"})]
    with admin.admin.api_keys.with_streaming_response.retrieve("key_1") as response:
        assert isinstance(response, diptych.StreamedAPIResponse)
        assert (response.status_code, response.method) == (200, "GET")
        assert response.url == f"{http.url}/api/v1/api-keys/key_1"
        assert response.request_id == "req_1" and response.rate_limits == diptych.RateLimitStatus(limit_requests=5)
        assert not response.is_closed  # the body is still to be read
        key = response.parse()
        assert key.id == "key_1" and response.parse() is key
        assert response.json() == KEY  # the body is kept once read
    assert response.is_closed


def test_a_body_is_iterated_line_by_line_as_it_arrives(http, admin):
    http.script = [Reply(raw=LINES, content_type="application/jsonl")]
    with admin.files.with_streaming_response.content("file_1") as response:
        assert response.headers["content-type"] == "application/jsonl"
        assert list(response.iter_lines()) == ['{"custom_id": "a"}', '{"custom_id": "b"}', '{"custom_id": "c"}']
        with pytest.raises(RuntimeError, match="already read"):
            response.read()
    with admin.files.with_streaming_response.content("file_1") as response:
        assert response.read() == LINES == response.parse()  # read whole, the body is kept and iterated from there
        assert b"".join(response.iter_bytes(chunk_size=4)) == LINES and "".join(response.iter_text()) == LINES.decode()


def test_a_streamed_list_parses_to_a_page_that_walks_the_next_pages(http, admin):
    second = {**KEY, "id": "key_2"}
    http.script = [
        Reply(body={"data": [KEY], "has_more": True, "total": 2}),
        Reply(body={"data": [second], "has_more": False, "total": 2}),
    ]
    with admin.admin.api_keys.with_streaming_response.list(limit=1, extra_query={"q": "x"}) as response:
        page = response.parse()
    assert isinstance(page, diptych.Page) and [key.id for key in page] == ["key_1", "key_2"]
    assert [seen.path for seen in http.seen] == [
        "/api/v1/api-keys?limit=1&q=x",
        "/api/v1/api-keys?limit=1&offset=1&q=x",  # the next page keeps the call's options
    ]


def test_an_error_status_raises_on_entering_the_block(http, admin):
    http.script = [Reply(status=404, body={"error": {"type": "not_found", "message": "no such key"}})]
    with pytest.raises(diptych.NotFoundError), admin.admin.api_keys.with_streaming_response.retrieve("gone"):
        pytest.fail("the block must not run")


def test_nothing_is_sent_before_entering_the_block(http, admin):
    http.script = [Reply(body=KEY)]
    manager = admin.admin.api_keys.with_streaming_response.revoke("key_1")
    assert http.seen == []
    with manager as response:
        assert response.parse().id == "key_1"
    assert [seen.method for seen in http.seen] == ["POST"]


async def test_async_streaming_responses(http):
    http.script = [
        Reply(body={"data": [KEY], "has_more": True, "total": 2}),
        Reply(body={"data": [{**KEY, "id": "key_2"}], "has_more": False, "total": 2}),
        Reply(raw=LINES, content_type="application/jsonl"),
    ]
    async with diptych.AsyncClient(api_key="k", admin_url=http.url, max_retries=0) as client:
        async with client.admin.api_keys.with_streaming_response.list(limit=1) as response:
            assert isinstance(response, diptych.AsyncStreamedAPIResponse) and response.status_code == 200
            page = await response.parse()
        assert isinstance(page, diptych.AsyncPage) and [key.id async for key in page] == ["key_1", "key_2"]
        async with client.files.with_streaming_response.content("file_1") as response:
            lines = [line async for line in response.iter_lines()]
        assert lines == ['{"custom_id": "a"}', '{"custom_id": "b"}', '{"custom_id": "c"}'] and response.is_closed


# ---- per-call options on the HTTP methods ----------------------------------------------------------------


def test_a_post_carries_the_calls_headers_query_body_and_idempotency_key(http, admin):
    http.script = [Reply(body={**KEY, "key": "dip_secret"})]
    admin.admin.api_keys.create(
        name="ci",
        extra_headers={"X-Trace-Id": "t-1"},
        extra_query={"dry_run": "1"},
        extra_body={"note": "n", "name": "over"},
        idempotency_key="create-ci-1",
    )
    (seen,) = http.seen
    assert seen.path == "/api/v1/api-keys?dry_run=1"
    assert seen.headers["X-Trace-Id"] == "t-1" and seen.headers["Idempotency-Key"] == "create-ci-1"
    assert seen.body == {"name": "over", "expires_at": None, "note": "n"}


def test_the_idempotency_key_is_the_same_on_every_retry(http):
    http.script = [Reply(status=503, body={}, headers={"Retry-After": "0"}), Reply(body=KEY)]
    with diptych.Client(api_key="k", admin_url=http.url, max_retries=1) as client:
        client.admin.api_keys.revoke("key_1", idempotency_key="revoke-1")
    assert [seen.headers["Idempotency-Key"] for seen in http.seen] == ["revoke-1", "revoke-1"]


def test_options_on_a_patch_and_a_get(http, admin):
    limits = {
        "organization_id": "org_1",
        "requests_per_minute": 6,
        "input_tokens_per_minute": None,
        "output_tokens_per_minute": None,
        "spend_limit_micros": None,
    }
    http.script = [Reply(body=limits)]
    admin.admin.limits.update(requests_per_minute=6, extra_body={"input_tokens_per_minute": 9})
    admin.admin.billing.with_raw_response.current  # noqa: B018 - the attribute exists beside the options
    admin.admin.limits.retrieve(extra_headers={"X-A": "b"}, extra_query={"at": "now"})
    assert http.seen[0].method == "PATCH"
    assert http.seen[0].body == {"requests_per_minute": 6, "input_tokens_per_minute": 9}
    assert http.seen[1].path == "/api/v1/limits?at=now" and http.seen[1].headers["X-A"] == "b"
    assert "Idempotency-Key" not in http.seen[1].headers


def test_a_calls_timeout_overrides_the_clients(http, admin):
    http.script = [Reply(body=KEY, delay=2.0)]
    started = time.monotonic()
    with pytest.raises(diptych.APITimeoutError):
        admin.admin.api_keys.retrieve("key_1", timeout=0.3)
    assert time.monotonic() - started < 1.5  # the client's own is 5 s


@pytest.mark.parametrize(
    ("call", "error"),
    [
        (lambda c: c.admin.billing.current(extra_body={"x": 1}), "GET request has no body"),
        (lambda c: c.files.delete("file_1", extra_body={"x": 1}), "DELETE request has no body"),
        (lambda c: c.admin.invoices.list(extra_query=["a"]), "extra_query must be a mapping"),
        (lambda c: c.batches.cancel("b", idempotency_key=""), "idempotency_key must be"),
        (lambda c: c.batches.cancel("b", idempotency_key="x" * 256), "idempotency_key must be"),
        (lambda c: c.files.retrieve("f", timeout=-1), "timeout must be a positive number"),
    ],
)
def test_bad_options_are_refused_before_sending(http, admin, call, error):
    http.script = [Reply(body={"id": "b"})]
    with pytest.raises(ValueError, match=error):
        call(admin)
    assert http.seen == []


def test_an_unknown_option_is_a_type_error(http, admin):
    with pytest.raises(TypeError):
        admin.admin.api_keys.retrieve("key_1", extra_header={"a": "b"})  # type: ignore[call-arg]
    assert http.seen == []


async def test_async_admin_calls_take_the_same_options(http):
    http.script = [Reply(body=KEY)]
    async with diptych.AsyncClient(api_key="k", admin_url=http.url, max_retries=0) as client:
        await client.admin.api_keys.revoke("key_1", extra_headers={"X-Trace-Id": "t"}, idempotency_key="r-1")
    (seen,) = http.seen
    assert seen.headers["X-Trace-Id"] == "t" and seen.headers["Idempotency-Key"] == "r-1"


# ---- with_streaming_response over gRPC -------------------------------------------------------------------


def test_a_grpc_stream_in_a_with_block_has_the_metadata_and_is_cancelled_on_leaving(server):
    server.servicer.script = [tokens(("Hel", [1]), ("lo", [2]), initial_metadata=LIMITS)]
    with diptych.Client(api_key="k", base_url=server.base_url, max_retries=0) as client:
        with client.chat.completions.with_streaming_response.create(model="m", messages=USER, stream=True) as raw:
            assert raw.request_id == request_id_of(server.servicer.requests[0])
            assert raw.headers["x-ratelimit-limit-requests"] == "10"
            stream = raw.parse()
            first = next(iter(stream))
        assert first.text == "Hel"
        assert server.servicer.call_ended.wait(5)  # leaving the block closed the stream


async def test_async_grpc_streaming_responses(server):
    server.servicer.script = [tokens(("Hello", [1]), initial_metadata=LIMITS)]
    async with diptych.AsyncClient(api_key="k", base_url=server.base_url, max_retries=0) as client:
        async with client.completions.with_streaming_response.create(model="m", prompt="x") as raw:
            assert raw.parse().text == "Hello" and raw.rate_limits is not None
        async with client.models.with_streaming_response.list() as raw:
            assert isinstance(raw.parse(), diptych.AsyncPage)
