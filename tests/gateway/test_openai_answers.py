"""What OpenAI clients and operators key on in the gateway's answers and metrics: a too-long prompt is
`context_length_exceeded` naming the prompt's field; chat answers carry `service_tier` and
`system_fingerprint`, as the official `openai` client parses them; an unserved path or method is answered in
OpenAI's shape with what is served; every generating request is counted once, refused at the door or not, and
timed once from arrival to its last byte; prompt tokens are counted per model."""

import json

import grpc
import openai
import pytest
from prometheus_client import REGISTRY

from gateway.fleet.registry import ModelInfo
from gateway.openai_api.errors import served_routes
from gateway.openai_api.responses import system_fingerprint
from gateway.routing.route import ServingMode
from tests.gateway.harness import (
    API_KEY,
    GENERATE_METHOD,
    MODEL,
    assert_openai_error_shape,
    in_process_gateway,
    post_json,
)
from tests.gateway.responses_harness import responses_gateway
from tests.workers.conftest import executor, tiny_model  # noqa: F401 - the workers' fixtures
from workers.serving.server import Role

CHAT_URL, COMPLETIONS_URL = "/v1/chat/completions", "/v1/completions"
TOO_LONG_TEXT = "hello " * 1500  # within the byte bound of the 1024-token context, over its tokens
TOO_MANY_BYTES = "x" * 20_000  # over the byte bound (16 bytes per token of the context)


@pytest.fixture
async def gateway(tmp_path):
    async with in_process_gateway(tmp_path) as gw:
        yield gw


@pytest.fixture
async def serving(tmp_path, tiny_model, executor):  # noqa: F811
    """A gateway over one colocated worker of the built-in model, and the official client pointed at it."""
    roles = {"colocated-0": Role.COLOCATED}
    async with (
        responses_gateway(tmp_path, tiny_model, executor, roles, ServingMode.COLOCATED) as gw,
        openai.AsyncOpenAI(api_key=API_KEY, base_url=gw.base_url, max_retries=0) as client,
    ):
        yield gw, client


def metric(name: str, **labels: str) -> float:
    """The sum of a metric's samples whose labels include `labels`."""
    return sum(
        sample.value
        for family in REGISTRY.collect()
        for sample in family.samples
        if sample.name == name and all(sample.labels.get(key) == value for key, value in labels.items())
    )


async def post(gateway, url: str, body, headers: dict | None = None):
    raw = body if isinstance(body, bytes) else json.dumps(body).encode()
    return await post_json(gateway, url, raw, headers)


# ---- a prompt longer than the context ----------------------------------------------------------------


@pytest.mark.parametrize(
    ("url", "body", "param"),
    [
        (CHAT_URL, {"messages": [{"role": "user", "content": TOO_LONG_TEXT}]}, "messages"),
        (CHAT_URL, {"messages": [{"role": "user", "content": TOO_MANY_BYTES}]}, "messages"),
        (CHAT_URL, {"messages": [{"role": "user", "content": TOO_MANY_BYTES[:10_000]}] * 2}, "messages"),
        (COMPLETIONS_URL, {"prompt": TOO_LONG_TEXT}, "prompt"),
        (COMPLETIONS_URL, {"prompt": TOO_MANY_BYTES}, "prompt"),
        (COMPLETIONS_URL, {"prompt": list(range(1100))}, "prompt"),
    ],
)
async def test_a_prompt_longer_than_the_context_is_context_length_exceeded(gateway, url, body, param):
    status, payload = await post(gateway, url, {"model": MODEL, **body})
    assert status == 400
    assert_openai_error_shape(payload)
    assert payload["error"]["type"] == "invalid_request_error"
    assert (payload["error"]["code"], payload["error"]["param"]) == ("context_length_exceeded", param)
    assert gateway.path.runs == 0


async def test_the_openai_client_reads_context_length_exceeded(gateway):
    base_url = str(gateway.http.make_url("/v1"))
    async with openai.AsyncOpenAI(api_key=API_KEY, base_url=base_url, max_retries=0) as client:
        with pytest.raises(openai.BadRequestError) as refused:
            await client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": TOO_LONG_TEXT}])
    assert refused.value.code == "context_length_exceeded" and refused.value.param == "messages"


async def test_other_refusals_keep_their_own_code(gateway):
    status, payload = await post(gateway, CHAT_URL, {"model": MODEL, "messages": [], "max_tokens": 5})
    assert status == 400 and payload["error"]["code"] is None and payload["error"]["param"] == "messages"


# ---- service_tier and system_fingerprint ------------------------------------------------------------


def test_the_fingerprint_names_the_model_and_its_revision():
    model = ModelInfo(MODEL, f"builtin:{MODEL}", 1024)
    fingerprint = system_fingerprint(model)
    assert fingerprint.startswith("fp_") and len(fingerprint) == 13
    assert system_fingerprint(ModelInfo(MODEL, f"builtin:{MODEL}", 1024)) == fingerprint  # stable
    assert system_fingerprint(ModelInfo(MODEL, f"builtin:{MODEL}", 1024, revision="r2")) != fingerprint
    assert system_fingerprint(ModelInfo("other", f"builtin:{MODEL}", 1024)) != fingerprint


@pytest.mark.parametrize("tier", [None, "auto", "default"])
async def test_a_chat_answer_carries_its_service_tier_and_fingerprint(serving, tier):
    _gateway, client = serving
    extra = {} if tier is None else {"service_tier": tier}
    answer = await client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=3, **extra
    )
    assert answer.service_tier == "default"
    assert answer.system_fingerprint == system_fingerprint(ModelInfo(MODEL, f"builtin:{MODEL}", 1024))


async def test_every_streamed_chunk_carries_them(serving):
    _gateway, client = serving
    stream = await client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Hi"}],
        max_tokens=4,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = [chunk async for chunk in stream]
    assert len(chunks) >= 3 and chunks[-1].usage is not None  # the role, the text, the usage
    expected = system_fingerprint(ModelInfo(MODEL, f"builtin:{MODEL}", 1024))
    assert {(chunk.service_tier, chunk.system_fingerprint) for chunk in chunks} == {("default", expected)}


async def test_a_completion_carries_its_fingerprint(serving):
    _gateway, client = serving
    answer = await client.completions.create(model=MODEL, prompt="Hello", max_tokens=3)
    assert answer.system_fingerprint == system_fingerprint(ModelInfo(MODEL, f"builtin:{MODEL}", 1024))


@pytest.mark.parametrize("tier", ["flex", "priority", "scale", 3])
async def test_a_tier_not_served_is_refused_by_name(gateway, tier):
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "service_tier": tier}
    status, payload = await post(gateway, CHAT_URL, body)
    assert status == 400 and payload["error"]["param"] == "service_tier"
    assert repr(tier) in payload["error"]["message"] and "auto, default" in payload["error"]["message"]
    assert gateway.path.runs == 0


# ---- paths and methods not served --------------------------------------------------------------------


@pytest.mark.parametrize(
    ("method", "path"), [("POST", "/v1/embeddings"), ("POST", "/v1/moderations"), ("GET", "/v1/nope")]
)
async def test_a_path_not_served_is_a_404_listing_what_is(gateway, method, path):
    headers = {"Authorization": f"Bearer {API_KEY}"}
    async with gateway.http.request(method, path, json={}, headers=headers) as response:
        status, payload = response.status, await response.json()
    assert status == 404
    assert_openai_error_shape(payload)
    assert payload["error"]["code"] == "unknown_url" and payload["error"]["type"] == "invalid_request_error"
    message = payload["error"]["message"]
    assert message.startswith(f"{method} {path} is not served")
    served = served_routes(gateway.http.app)
    assert "POST /v1/chat/completions" in served and "GET /v1/models/{model}" in served
    assert all(route in message for route in served)


def test_the_served_routes_come_from_the_router(gateway):
    routes = {
        f"{route.method} {route.resource.canonical}"
        for route in gateway.http.app.router.routes()
        if route.method not in ("HEAD", "*")
    }
    assert set(served_routes(gateway.http.app)) == routes


async def test_the_openai_client_reads_the_404(gateway):
    base_url = str(gateway.http.make_url("/v1"))
    async with openai.AsyncOpenAI(api_key=API_KEY, base_url=base_url, max_retries=0) as client:
        with pytest.raises(openai.NotFoundError) as refused:
            await client.embeddings.create(model=MODEL, input="hi")
    assert refused.value.code == "unknown_url" and "POST /v1/completions" in refused.value.message


@pytest.mark.parametrize(
    ("method", "path", "allowed"),
    [("GET", CHAT_URL, "POST"), ("PUT", COMPLETIONS_URL, "POST"), ("DELETE", "/v1/models", "GET, HEAD")],
)
async def test_a_method_not_served_is_a_405_naming_the_allowed(gateway, method, path, allowed):
    async with gateway.http.request(method, path) as response:
        status, allow, payload = response.status, response.headers.get("Allow"), await response.json()
    assert status == 405 and allow == allowed
    assert_openai_error_shape(payload)
    assert payload["error"]["code"] == "method_not_allowed"
    assert payload["error"]["message"] == f"{method} is not served on {path}; send {allowed.replace(', ', ' or ')}"


# ---- counted and timed once -----------------------------------------------------------------------


BAD_AUTH = {"Authorization": "Bearer d\u00efp"}
REFUSED_AT_THE_DOOR = [  # (url, body, headers): each refused with a 400 (or 401), before or inside the pipeline
    (CHAT_URL, b"{not json", None),
    (CHAT_URL, {"model": MODEL}, None),
    (CHAT_URL, {"model": 7, "messages": [{"role": "user", "content": "Hi"}]}, None),
    (CHAT_URL, {"model": MODEL, "messages": [{"role": "robot", "content": "Hi"}]}, None),
    (CHAT_URL, {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "temperature": "hot"}, None),
    (CHAT_URL, {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "stream": "yes"}, None),
    (CHAT_URL, {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "frobnicate": 1}, None),
    (CHAT_URL, {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "service_tier": "flex"}, None),
    (CHAT_URL, {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "temperature": 9}, None),
    (CHAT_URL, {"model": MODEL, "messages": [{"role": "user", "content": TOO_LONG_TEXT}]}, None),
    (CHAT_URL, {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}]}, BAD_AUTH),
    (COMPLETIONS_URL, {"model": MODEL, "prompt": 5}, None),
    (COMPLETIONS_URL, {"model": MODEL, "prompt": "Hi", "best_of": 3}, None),
    (COMPLETIONS_URL, {"model": MODEL, "prompt": "Hi", "max_tokens": -1}, None),
    (COMPLETIONS_URL, {"model": MODEL, "prompt": "Hi", "max_tokens": 5000}, None),
    (COMPLETIONS_URL, {"model": MODEL, "prompt": ""}, None),
    (COMPLETIONS_URL, {"model": MODEL, "prompt": TOO_MANY_BYTES}, None),
    ("/v1/messages", {"model": MODEL, "max_tokens": 5}, None),
    ("/v1/messages", b"[]", None),
]


async def test_every_refusal_is_counted_and_timed_once(gateway):
    counted_before = metric("diptych_gateway_requests_total")
    timed_before = metric("diptych_gateway_request_duration_seconds_count")
    for url, body, headers in REFUSED_AT_THE_DOOR:
        status, _ = await post(gateway, url, body, headers)
        assert status in (400, 401), (url, body)
    call = gateway.channel.unary_stream(GENERATE_METHOD)(
        b"\xff\xff", metadata=(("authorization", f"Bearer {API_KEY}"),), timeout=10
    )
    with pytest.raises(grpc.aio.AioRpcError) as aborted:
        async for _ in call:
            pass
    assert aborted.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    sent = len(REFUSED_AT_THE_DOOR) + 1
    assert metric("diptych_gateway_requests_total") - counted_before == sent
    assert metric("diptych_gateway_request_duration_seconds_count") - timed_before == sent
    assert gateway.path.runs == 0


async def test_a_refusal_is_labelled_by_its_outcome_model_and_api(gateway):
    labels = {"model": MODEL, "api": "chat.completions", "outcome": "INVALID_ARGUMENT"}
    timed_before = metric("diptych_gateway_request_duration_seconds_count", **labels)
    counted_before = metric("diptych_gateway_requests_total", model=MODEL, code="INVALID_ARGUMENT", protocol="http")
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "stream": "yes"}
    assert (await post(gateway, CHAT_URL, body))[0] == 400
    assert metric("diptych_gateway_request_duration_seconds_count", **labels) - timed_before == 1
    counted = metric("diptych_gateway_requests_total", model=MODEL, code="INVALID_ARGUMENT", protocol="http")
    assert counted - counted_before == 1


async def test_a_failed_request_is_timed_with_its_outcome(gateway):
    """Over a fleet with no workers, a request that passed every check ends UNAVAILABLE."""
    labels = {"model": MODEL, "api": "completions", "outcome": "UNAVAILABLE"}
    before = metric("diptych_gateway_request_duration_seconds_count", **labels)
    status, _ = await post(gateway, COMPLETIONS_URL, {"model": MODEL, "prompt": "Hi", "max_tokens": 2})
    assert status == 503
    assert metric("diptych_gateway_request_duration_seconds_count", **labels) - before == 1


async def test_a_served_request_counts_its_prompt_tokens_and_is_timed_to_its_last_byte(serving):
    _gateway, client = serving
    whole = {"model": MODEL, "api": "chat.completions", "outcome": "OK"}
    streamed_before = metric("diptych_gateway_request_duration_seconds_count", **whole)
    prompt_before = metric("diptych_gateway_prompt_tokens_total", model=MODEL)
    answer = await client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=3, n=2
    )
    stream = await client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Hello there"}],
        max_tokens=3,
        stream=True,
        stream_options={"include_usage": True},
    )
    usage = [chunk async for chunk in stream][-1].usage
    prompts = answer.usage.prompt_tokens + usage.prompt_tokens  # once per request, whatever its n
    assert metric("diptych_gateway_prompt_tokens_total", model=MODEL) - prompt_before == prompts
    assert metric("diptych_gateway_request_duration_seconds_count", **whole) - streamed_before == 2
    responses = {"model": MODEL, "api": "responses", "outcome": "OK"}
    before = metric("diptych_gateway_request_duration_seconds_count", **responses)
    await client.responses.create(model=MODEL, input="Hi", max_output_tokens=3)
    assert metric("diptych_gateway_request_duration_seconds_count", **responses) - before == 1
