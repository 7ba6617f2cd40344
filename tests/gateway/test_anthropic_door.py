"""The Messages API at the gateway's door, in process over a fleet with no workers: what it refuses (in
Anthropic's error shape, with the status its client maps to the matching exception, running and billing
nothing), its headers (API keys, anthropic-version, rate limits, request ids), count_tokens, and a bounded
fuzz that never gets a server error. A request the door lets through ends in the fleet's UNAVAILABLE, a 529
overloaded_error; tests/gateway/test_anthropic_generation.py runs them on a real worker."""

import asyncio
import gzip
import json

import anthropic
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from gateway.anthropic_api.params import ANTHROPIC_VERSIONS
from gateway.bodies import MAX_BODY_BYTES
from gateway.fleet.registry import Registry
from gateway.openai_api.requests import to_generation_request
from gateway.planning.validation import plan_generation
from tests.gateway.harness import API_KEY, MODEL, ControlPlaneInMemory, in_process_gateway

MESSAGES = "/v1/messages"
COUNT_TOKENS = "/v1/messages/count_tokens"
VALID = {"model": MODEL, "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]}
ERROR_TYPES = {
    "invalid_request_error",
    "authentication_error",
    "permission_error",
    "not_found_error",
    "rate_limit_error",
    "request_too_large",
    "api_error",
    "overloaded_error",
}


@pytest.fixture
async def gateway(tmp_path):
    async with in_process_gateway(tmp_path) as gateway:
        yield gateway


async def post(gateway, path: str, payload, headers: dict | None = None):
    """Status, headers and parsed answer of one POST with the test key in x-api-key, as Anthropic's clients
    send it (`payload`: an object, or the body's bytes)."""
    data = payload if isinstance(payload, bytes) else json.dumps(payload).encode()
    sent = {"x-api-key": API_KEY, "anthropic-version": "2023-06-01", "Content-Type": "application/json"}
    async with gateway.http.post(path, data=data, headers={**sent, **(headers or {})}) as response:
        raw = await response.read()
    return response.status, response.headers, _parsed(raw, response.content_type)


def _parsed(raw: bytes, content_type: str):
    if content_type == "text/event-stream":
        return raw
    return json.loads(raw)


def assert_anthropic_error(payload, kind: str) -> None:
    assert set(payload) == {"type", "error", "request_id"} and payload["type"] == "error", payload
    assert payload["error"]["type"] == kind, payload
    assert isinstance(payload["error"]["message"], str) and payload["error"]["message"]


def ran_and_billed_nothing(gateway) -> bool:
    return gateway.path.runs == 0 and gateway.journal.count() == 0


def test_the_versions_accepted_are_the_one_the_client_sends_and_the_classic_one():
    assert anthropic._constants.ANTHROPIC_API_VERSION in ANTHROPIC_VERSIONS and "2023-06-01" in ANTHROPIC_VERSIONS


async def test_a_valid_message_passes_the_door_and_reaches_the_fleet(gateway):
    status, headers, payload = await post(gateway, MESSAGES, VALID)
    assert status == 529, payload  # the fleet has no workers: overloaded, which the client retries
    assert_anthropic_error(payload, "overloaded_error")
    assert payload["request_id"] == headers["request-id"] == headers["X-Request-Id"]
    assert headers["request-id"].startswith("exec_") and headers["request-id"] in payload["error"]["message"]
    assert gateway.path.runs == 1


async def test_a_streamed_message_that_fails_after_it_started_ends_in_an_error_event(gateway):
    status, headers, raw = await post(gateway, MESSAGES, {**VALID, "stream": True})
    assert status == 200 and headers["Content-Type"] == "text/event-stream"
    events = [block.split("\n") for block in raw.decode().strip().split("\n\n")]
    assert [lines[0] for lines in events] == ["event: message_start", "event: ping", "event: error"]
    error = json.loads(events[-1][1].removeprefix("data: "))
    assert_anthropic_error(error, "overloaded_error")
    start = json.loads(events[0][1].removeprefix("data: "))["message"]
    assert start["id"] == "msg_" + headers["request-id"].removeprefix("exec_") and start["content"] == []


HUGE_PROMPT = "ab " * 6000  # 18 KB: over the 16 bytes per token of diptych-tiny's 1,024-token context
BAD_BODIES = [
    (b"{not json", 400, "not valid JSON"),
    (b'{"model": "diptych-tiny", "max_tokens": 4, "messages": [{"role": "user", "content": "\xff\xfe"}]}', 400,
     "not valid JSON"),
    (json.dumps({**VALID, "messages": [{"role": "user", "content": "\ud800"}]}).encode(), 400, "lone UTF-16 surrogate"),
    (b'{"model": "diptych-tiny", "max_tokens": 4, "messages": ' + b"[" * 40 + b"]" * 40 + b"}", 400, "nests deeper"),
    (b"[1, 2]", 400, "must be a JSON object"),
    (json.dumps({**VALID, "temperature": 0.5, "frequency_penalty": 1}).encode(), 400, "'frequency_penalty' is not a"),
    (json.dumps({**VALID, "max_tokens": "4"}).encode(), 400, "max_tokens must be an integer"),
    (json.dumps({k: v for k, v in VALID.items() if k != "max_tokens"}).encode(), 400, "max_tokens is required"),
    (json.dumps({**VALID, "messages": []}).encode(), 400, "messages must be a non-empty list"),
    (json.dumps({**VALID, "messages": [{"role": "assistant", "content": "a"}, {"role": "user", "content": "b"}]})
     .encode(), 400, "the conversation starts with a user message"),
    (json.dumps({**VALID, "messages": [{"role": "user", "content": HUGE_PROMPT}]}).encode(), 400,
     "takes at most 16384 bytes of prompt text"),
    (json.dumps({**VALID, "max_tokens": 5000}).encode(), 400, "lower max_tokens"),
    (json.dumps({**VALID, "messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]}).encode(), 400,
     "read text only"),
    (json.dumps({**VALID, "thinking": {"type": "enabled", "budget_tokens": 1024}}).encode(), 400, "thinks"),
    (json.dumps({**VALID, "tools": [{"name": "f", "input_schema": {"$ref": "#"}}]}).encode(), 400,
     "is not a schema this platform can follow"),
    (b"{" + b'"pad": "' + b"x" * MAX_BODY_BYTES + b'"}', 413, "larger than"),
]  # fmt: skip


@pytest.mark.parametrize(("raw", "status", "message"), BAD_BODIES)
async def test_bad_input_is_refused_in_anthropic_s_shape_and_changes_nothing(gateway, raw, status, message):
    answered, headers, payload = await post(gateway, MESSAGES, raw)
    assert answered == status, payload
    assert_anthropic_error(payload, "request_too_large" if status == 413 else "invalid_request_error")
    assert message in payload["error"]["message"]
    assert headers["request-id"] == payload["request_id"]
    assert ran_and_billed_nothing(gateway)


async def test_a_compressed_body_is_read_as_the_chat_api_reads_it(gateway):
    status, _, payload = await post(
        gateway, MESSAGES, gzip.compress(json.dumps(VALID).encode()), {"Content-Encoding": "gzip"}
    )
    assert status == 529, payload
    status, _, payload = await post(gateway, MESSAGES, b"not gzip", {"Content-Encoding": "gzip"})
    assert status == 400 and "not valid gzip data" in payload["error"]["message"]


@pytest.mark.parametrize(
    ("headers", "status", "kind", "message"),
    [
        ({"x-api-key": ""}, 401, "authentication_error", "missing API key"),
        ({"x-api-key": "dip_wrong"}, 401, "authentication_error", "the API key is not valid"),
        ({"x-api-key": "", "Authorization": f"Bearer {API_KEY}"}, 529, "overloaded_error", "retry it"),
        ({"anthropic-version": "2022-01-01"}, 400, "invalid_request_error", "anthropic-version '2022-01-01' is not"),
        ({"anthropic-beta": "prompt-caching-2024-07-31"}, 400, "invalid_request_error", "beta features are not"),
        ({"anthropic-workspace-id": "wrkspc_1"}, 400, "invalid_request_error", "workspaces are not served"),
        ({"Idempotency-Key": "cl\u00e9".encode().decode("latin-1")}, 400, "invalid_request_error", "Idempotency-Key"),
    ],
)
async def test_keys_and_anthropic_headers(gateway, headers, status, kind, message):
    answered, _, payload = await post(gateway, MESSAGES, VALID, headers)
    assert answered == status, payload
    assert_anthropic_error(payload, kind)
    assert message in payload["error"]["message"]


async def test_a_request_without_anthropic_version_is_served(gateway):
    async with gateway.http.post(MESSAGES, json=VALID, headers={"x-api-key": API_KEY}) as response:
        assert response.status == 529


async def test_an_unknown_model_is_a_not_found_error(gateway):
    status, _headers, payload = await post(gateway, MESSAGES, {**VALID, "model": "claude-9"})
    assert status == 404
    assert_anthropic_error(payload, "not_found_error")
    assert "model 'claude-9' does not exist" in payload["error"]["message"]
    assert ran_and_billed_nothing(gateway)


async def test_routes_beside_the_api_answer_in_its_shape(gateway):
    async with gateway.http.get(MESSAGES, headers={"x-api-key": API_KEY}) as response:
        assert response.status == 405 and response.headers["Allow"] == "POST"
        assert_anthropic_error(await response.json(), "invalid_request_error")
    status, _, payload = await post(gateway, "/v1/messages/batches", VALID)
    assert status == 404
    assert_anthropic_error(payload, "not_found_error")


async def test_rate_limits_refuse_as_on_chat_and_send_anthropic_s_headers(tmp_path):
    control_plane = ControlPlaneInMemory({"limits": {"api_key": {"requests_per_minute": 1}}})
    async with in_process_gateway(tmp_path, control_plane) as gateway:
        _, first, _ = await post(gateway, MESSAGES, VALID)
        status, second, payload = await post(gateway, MESSAGES, VALID)
    assert first["anthropic-ratelimit-requests-limit"] == first["x-ratelimit-limit-requests"] == "1"
    assert first["anthropic-ratelimit-requests-remaining"] == "0"
    assert first["anthropic-ratelimit-requests-reset"].endswith("Z")
    assert status == 429
    assert_anthropic_error(payload, "rate_limit_error")
    assert int(second["retry-after"]) >= 1 and int(second["retry-after-ms"]) > 0
    assert second["anthropic-ratelimit-requests-remaining"] == "0"
    assert gateway.path.runs == 1


async def test_a_spend_limit_is_a_rate_limit_error_with_anthropic_s_code(tmp_path):
    control_plane = ControlPlaneInMemory({"spend": {"limit_micros": 5_000_000, "over_limit": True}})
    async with in_process_gateway(tmp_path, control_plane) as gateway:
        status, _, payload = await post(gateway, MESSAGES, VALID)
        assert ran_and_billed_nothing(gateway)
    assert status == 429
    assert_anthropic_error(payload, "rate_limit_error")
    assert payload["error"]["details"] == {"error_code": "enforced_spend_limit_reached"}


async def test_count_tokens_counts_the_prompt_the_chat_api_would_run(gateway):
    tools = [{"name": "get_weather", "description": "weather", "input_schema": {"type": "object"}}]
    counted = {"model": MODEL, "system": "be brief", "messages": [{"role": "user", "content": "hello"}], "tools": tools}
    status, headers, payload = await post(gateway, COUNT_TOKENS, counted)
    assert status == 200, payload
    chat = to_generation_request(
        {
            "model": MODEL,
            "messages": [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello"}],
            "tools": [{"type": "function", "function": {"name": "get_weather", "description": "weather",
                                                        "parameters": {"type": "object"}}}],
        },
        chat=True,
        idempotency_key="",
    )  # fmt: skip
    registry = Registry(ControlPlaneInMemory())
    await registry.refresh()
    plan = await plan_generation(chat, registry, "org_1")
    assert payload == {"input_tokens": len(plan.prompt_token_ids)}
    assert headers["request-id"].startswith("req_")
    assert ran_and_billed_nothing(gateway)


async def test_count_tokens_refuses_as_messages_does(gateway):
    status, _, payload = await post(gateway, COUNT_TOKENS, {"model": MODEL, "messages": []})
    assert status == 400 and "messages must be a non-empty list" in payload["error"]["message"]
    status, _, payload = await post(gateway, COUNT_TOKENS, {"model": MODEL, "messages": VALID["messages"]},
                                    {"x-api-key": "dip_wrong"})  # fmt: skip
    assert status == 401
    assert_anthropic_error(payload, "authentication_error")


async def test_count_tokens_takes_nothing_from_the_rate_limits(tmp_path):
    control_plane = ControlPlaneInMemory({"limits": {"api_key": {"requests_per_minute": 1}}})
    async with in_process_gateway(tmp_path, control_plane) as gateway:
        for _ in range(3):
            status, headers, _ = await post(gateway, COUNT_TOKENS, {"model": MODEL, "messages": VALID["messages"]})
            assert status == 200 and headers["anthropic-ratelimit-requests-remaining"] == "1"


async def test_the_official_client_raises_its_matching_exceptions(tmp_path):
    control_plane = ControlPlaneInMemory({"limits": {"api_key": {"requests_per_minute": 1}}})
    async with in_process_gateway(tmp_path, control_plane) as gateway:
        base_url = str(gateway.http.make_url("")).rstrip("/")
        async with anthropic.AsyncAnthropic(api_key=API_KEY, base_url=base_url, max_retries=0) as client:
            with pytest.raises(anthropic.BadRequestError) as raised:  # checked at the door: takes no request
                await client.messages.create(model=MODEL, max_tokens=4, messages=VALID["messages"],
                                             extra_body={"temperature": 3})  # fmt: skip
            assert raised.value.type == "invalid_request_error" and raised.value.request_id.startswith("req_")
            with pytest.raises(anthropic.NotFoundError):
                await client.messages.create(model="claude-9", max_tokens=4, messages=VALID["messages"])
            with pytest.raises(anthropic.OverloadedError):
                await client.messages.create(model=MODEL, max_tokens=4, messages=VALID["messages"])
            with pytest.raises(anthropic.RateLimitError) as limited:
                await client.messages.create(model=MODEL, max_tokens=4, messages=VALID["messages"])
            assert limited.value.type == "rate_limit_error"
            assert (await client.messages.count_tokens(model=MODEL, messages=VALID["messages"])).input_tokens > 0
        async with anthropic.AsyncAnthropic(api_key="dip_wrong", base_url=base_url, max_retries=0) as wrong:
            with pytest.raises(anthropic.AuthenticationError):
                await wrong.messages.create(model=MODEL, max_tokens=4, messages=VALID["messages"])


async def test_a_key_without_the_inference_scope_is_a_permission_error(tmp_path):
    async with in_process_gateway(tmp_path, ControlPlaneInMemory({"scopes": ["usage:read"]})) as gateway:
        base_url = str(gateway.http.make_url("")).rstrip("/")
        async with anthropic.AsyncAnthropic(api_key=API_KEY, base_url=base_url, max_retries=0) as client:
            with pytest.raises(anthropic.PermissionDeniedError):
                await client.messages.create(model=MODEL, max_tokens=4, messages=VALID["messages"])


FUZZ = settings(
    max_examples=150,
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.function_scoped_fixture],
)
surrogates = st.sampled_from(["\ud800", "a\udfffb", "x\udc00\ud800"])
texts = st.one_of(st.text(max_size=20), surrogates, st.integers(0, 12_000).map(lambda n: "ab" * n))
scalars = st.one_of(st.none(), st.booleans(), st.integers(-(2**70), 2**70), st.floats(), texts)
json_values = st.recursive(
    scalars, lambda inner: st.lists(inner, max_size=4) | st.dictionaries(texts, inner, max_size=4), max_leaves=12
)
blocks = st.one_of(
    st.fixed_dictionaries({"type": st.just("text"), "text": texts}),
    st.fixed_dictionaries({"type": st.just("tool_use"), "id": texts, "name": texts, "input": json_values}),
    st.fixed_dictionaries({"type": st.just("tool_result"), "tool_use_id": texts, "content": json_values}),
    st.fixed_dictionaries({"type": st.sampled_from(["image", "thinking", "document"])}),
    json_values,
)
messages = st.lists(
    st.fixed_dictionaries(
        {"role": st.one_of(st.sampled_from(["user", "assistant", "system"]), json_values)},
        optional={"content": st.one_of(texts, st.lists(blocks, max_size=3), json_values)},
    ),
    max_size=3,
)
field_values = {
    "model": st.one_of(st.just(MODEL), json_values),
    "messages": st.one_of(messages, json_values),
    "max_tokens": st.one_of(st.integers(-3, 2000), json_values),
    "system": st.one_of(texts, st.lists(blocks, max_size=2), json_values),
    "temperature": st.one_of(st.floats(-1, 2), json_values),
    "stop_sequences": st.one_of(st.lists(texts, max_size=6), json_values),
    "stream": st.one_of(st.booleans(), json_values),
    "tools": st.one_of(
        st.lists(st.fixed_dictionaries({"name": texts, "input_schema": json_values}), max_size=2), json_values
    ),
    "tool_choice": st.one_of(st.fixed_dictionaries({"type": st.sampled_from(["auto", "any", "tool"])}), json_values),
    "cache_control": st.one_of(st.just({"type": "ephemeral"}), json_values),
    "metadata": st.one_of(st.fixed_dictionaries({"user_id": texts}), json_values),
}
mutated = (
    st.lists(st.sampled_from(sorted(field_values)), min_size=1, max_size=3, unique=True)
    .flatmap(lambda names: st.fixed_dictionaries({name: field_values[name] for name in names}))
    .map(lambda changes: {**VALID, **changes})
)
bodies = st.one_of(mutated, mutated, json_values, st.binary(max_size=64))


def _sent(body, path: str) -> bytes:
    """The body's bytes; count_tokens gets it without max_tokens, which it does not take."""
    if isinstance(body, bytes):
        return body
    if path == COUNT_TOKENS and isinstance(body, dict):
        body = {key: value for key, value in body.items() if key not in ("max_tokens", "stream")}
    return json.dumps(body).encode()


def _check_answer(status: int, content_type: str, raw: bytes) -> None:
    """A 4xx for what the door refuses; a request it lets through ends at the fleet with no workers: a 529,
    or a stream that ends in its error event; a count of tokens is answered."""
    if status == 200 and content_type == "application/json":
        assert isinstance(json.loads(raw)["input_tokens"], int), raw[:500]
        return
    if status == 200 and content_type == "text/event-stream":
        assert raw.rstrip().split(b"\n")[-2] == b"event: error" and b'"overloaded_error"' in raw, raw[-300:]
        return
    assert 400 <= status < 500 or status == 529, raw[:500]
    payload = json.loads(raw)
    assert payload["type"] == "error" and payload["error"]["type"] in ERROR_TYPES, payload


async def _post_raw(gateway, path: str, raw: bytes):
    headers = {"x-api-key": API_KEY, "Content-Type": "application/json"}
    async with gateway.http.post(path, data=raw, headers=headers) as response:
        return response.status, response.content_type, await response.read()


def test_fuzzed_bodies_never_get_a_server_error(tmp_path):
    with asyncio.Runner() as runner:
        context = in_process_gateway(tmp_path)
        gateway = runner.run(context.__aenter__())
        try:

            @FUZZ
            @example(body={**VALID, "top_p": 10**400}, path=MESSAGES)
            @example(body={**VALID, "tool_choice": {"type": []}}, path=MESSAGES)
            @given(body=bodies, path=st.sampled_from([MESSAGES, COUNT_TOKENS]))
            def answer_is_never_a_server_error(body, path):
                _check_answer(*runner.run(_post_raw(gateway, path, _sent(body, path))))

            answer_is_never_a_server_error()
        finally:
            runner.run(context.__aexit__(None, None, None))
