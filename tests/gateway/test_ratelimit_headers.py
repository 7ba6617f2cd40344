"""The x-ratelimit-* headers and metadata: what the limiter reports of its buckets (in process and in Redis
alike), how the most constraining bucket becomes OpenAI's headers, and that every answer after
authentication carries them, over HTTP and gRPC. The requests here end at a fleet with no workers
(UNAVAILABLE after admission); tests/e2e/test_ratelimit_headers_live.py runs them on real workers."""

import json
import uuid

import grpc
import pytest

from diptych_proto.v1 import inference_pb2, inference_pb2_grpc
from gateway.accounts.auth import Caller, RateLimits
from gateway.accounts.limits import BucketState, RateLimited, RateLimiter
from gateway.accounts.ratelimit_headers import duration_text, rate_limit_metadata
from tests.gateway.harness import API_KEY, MODEL, ControlPlaneInMemory, in_process_gateway
from tests.gateway.test_limits import REDIS_URL, redis_reachable

HEADERS = (
    "x-ratelimit-limit-requests",
    "x-ratelimit-remaining-requests",
    "x-ratelimit-reset-requests",
    "x-ratelimit-limit-tokens",
    "x-ratelimit-remaining-tokens",
    "x-ratelimit-reset-tokens",
)
AUTHORIZATION = (("authorization", f"Bearer {API_KEY}"),)


def new_limiter(backend: str) -> RateLimiter:
    if backend == "redis":
        if not redis_reachable():
            pytest.skip(f"no Redis at {REDIS_URL}")
        return RateLimiter(REDIS_URL)
    return RateLimiter()


@pytest.fixture(params=["in-process", "redis"])
async def limiter(request):
    limiter = new_limiter(request.param)
    yield limiter
    await limiter.close()


def caller(org: RateLimits | None = None, key: RateLimits | None = None) -> Caller:
    return Caller(
        uuid.uuid4().hex, uuid.uuid4().hex, organization_limits=org or RateLimits(), key_limits=key or RateLimits()
    )


@pytest.mark.parametrize(
    ("milliseconds", "text"),
    [(0, "0s"), (1, "1ms"), (120, "120ms"), (999, "999ms"), (1000, "1s"), (1500, "1.5s"), (20_001, "20.001s"),
     (60_000, "1m0s"), (360_000, "6m0s"), (90_500, "1m30.5s"), (3_600_000, "1h0m0s")],
)  # fmt: skip
def test_durations_read_as_openai_writes_them(milliseconds, text):
    assert duration_text(milliseconds) == text


def state(scope: str, kind: str, capacity: int, remaining: int, reset_ms: int) -> BucketState:
    return BucketState(scope, kind, capacity, remaining, reset_ms)


def test_each_family_reports_its_most_constraining_bucket():
    states = [
        state("organization", "requests", 100, 40, 36_000),
        state("API key", "requests", 10, 9, 6_000),
        state("organization", "input tokens", 10_000, 9_000, 6_000),
        state("organization", "output tokens", 1_000, 200, 48_000),
        state("API key", "input tokens", 5_000, 4_500, 6_000),
    ]
    assert dict(rate_limit_metadata(states)) == {
        "x-ratelimit-limit-requests": "10",
        "x-ratelimit-remaining-requests": "9",
        "x-ratelimit-reset-requests": "6s",
        "x-ratelimit-limit-tokens": "1000",
        "x-ratelimit-remaining-tokens": "200",
        "x-ratelimit-reset-tokens": "48s",
    }


def test_a_tie_reports_the_smaller_limit():
    states = [state("organization", "requests", 50, 0, 1200), state("API key", "requests", 5, 0, 12_000)]
    assert dict(rate_limit_metadata(states))["x-ratelimit-limit-requests"] == "5"


def test_an_unlimited_family_is_left_out():
    only_requests = rate_limit_metadata([state("API key", "requests", 3, 2, 20_000)])
    assert [name for name, _ in only_requests] == list(HEADERS[:3])
    only_tokens = rate_limit_metadata([state("API key", "output tokens", 30, 20, 20_000)])
    assert [name for name, _ in only_tokens] == list(HEADERS[3:])
    assert rate_limit_metadata([]) == ()


async def test_remaining_is_after_each_take_and_a_refusal_shows_what_refused_it(limiter):
    who = caller(key=RateLimits(requests_per_minute=3, output_tokens_per_minute=100))
    remaining = []
    for _ in range(3):
        reservation = await limiter.admit(who, input_tokens=4, max_output_tokens=10)
        by_kind = {s.kind: s for s in reservation.states}
        remaining.append((by_kind["requests"].remaining, by_kind["output tokens"].remaining))
    assert remaining == [(2, 90), (1, 80), (0, 70)]
    with pytest.raises(RateLimited) as raised:
        await limiter.admit(who, input_tokens=4, max_output_tokens=10)
    by_kind = {s.kind: s for s in raised.value.states}
    assert by_kind["requests"].remaining == 0 and by_kind["output tokens"].remaining == 70  # nothing taken
    # A full bucket's worth (3 requests) comes back in a minute: 1 request in 20 s.
    assert 40_000 < by_kind["requests"].reset_ms <= 60_000
    assert 15_000 < raised.value.retry_after_ms <= 20_000


async def test_current_state_takes_nothing(limiter):
    who = caller(org=RateLimits(requests_per_minute=5, input_tokens_per_minute=50))
    assert {(s.kind, s.remaining, s.reset_ms) for s in await limiter.current(who)} == {
        ("requests", 5, 0),
        ("input tokens", 50, 0),
    }
    await limiter.admit(who, input_tokens=20, max_output_tokens=0)
    for _ in range(2):
        assert {s.kind: s.remaining for s in await limiter.current(who)} == {"requests": 4, "input tokens": 30}


async def test_a_request_bigger_than_the_limit_reports_the_state_without_taking(limiter):
    who = caller(key=RateLimits(requests_per_minute=2, output_tokens_per_minute=10))
    with pytest.raises(RateLimited) as raised:
        await limiter.admit(who, input_tokens=1, max_output_tokens=11)
    assert {s.kind: s.remaining for s in raised.value.states} == {"requests": 2, "output tokens": 10}


async def test_a_limit_of_zero_refuses_and_reports_a_full_empty_bucket(limiter):
    who = caller(key=RateLimits(requests_per_minute=0))
    with pytest.raises(RateLimited) as raised:
        await limiter.admit(who, input_tokens=1, max_output_tokens=1)
    assert [(s.remaining, s.reset_ms) for s in raised.value.states] == [(0, 0)]


async def test_a_lowered_limit_caps_the_bucket_at_once(limiter):
    who = caller(key=RateLimits(requests_per_minute=100))
    await limiter.admit(who, input_tokens=1, max_output_tokens=1)
    lowered = Caller(who.organization_id, who.api_key_id, key_limits=RateLimits(requests_per_minute=2))
    assert [s.remaining for s in (await limiter.admit(lowered, 1, 1)).states] == [1]


async def test_both_backends_report_the_same_state():
    if not redis_reachable():
        pytest.skip(f"no Redis at {REDIS_URL}")
    limits = RateLimits(requests_per_minute=7, input_tokens_per_minute=1000, output_tokens_per_minute=500)
    answers = []
    for limiter in (RateLimiter(), RateLimiter(REDIS_URL)):
        who = caller(org=limits, key=limits)
        try:
            reservation = await limiter.admit(who, input_tokens=300, max_output_tokens=100)
            answers.append([(s.scope, s.kind, s.capacity, s.remaining) for s in reservation.states])
            # Reset times are computed alike; milliseconds between the two runs may move them by a little.
            assert {s.kind: s.reset_ms for s in reservation.states} == pytest.approx(
                {"requests": 8572, "input tokens": 18_000, "output tokens": 12_000}, abs=50
            )
        finally:
            await limiter.close()
    assert answers[0] == answers[1]


# The in-process gateway: a key with small limits, the buckets in process or in Redis.


@pytest.fixture(params=["in-process", "redis"])
async def limited_gateway(request, tmp_path):
    identity = {
        "api_key_id": f"key_{uuid.uuid4().hex}",
        "organization_id": f"org_{uuid.uuid4().hex}",
        "limits": {"api_key": {"requests_per_minute": 3}, "organization": {"output_tokens_per_minute": 100}},
    }
    limiter = new_limiter(request.param)
    try:
        async with in_process_gateway(tmp_path, ControlPlaneInMemory(identity), limiter) as gateway:
            yield gateway
    finally:
        await limiter.close()


async def test_an_overdrawn_bucket_reports_0_remaining_never_a_negative_count(limiter, tmp_path):
    identity = {
        "api_key_id": f"key_{uuid.uuid4().hex}",
        "organization_id": f"org_{uuid.uuid4().hex}",
        "limits": {"organization": {"output_tokens_per_minute": 100}},
    }
    async with in_process_gateway(tmp_path, ControlPlaneInMemory(identity), limiter) as gateway:
        who, _ = await gateway.pipeline.authenticate(f"Bearer {API_KEY}")
        # An estimate of 10 output tokens that produced 160: the excess is taken at the end, 60 below zero.
        await limiter.settle(await limiter.admit(who, input_tokens=1, max_output_tokens=10), output_tokens=160)
        assert [state.remaining for state in await limiter.current(who)] == [-60]
        async with gateway.http.get("/v1/models", headers={"Authorization": f"Bearer {API_KEY}"}) as listed:
            assert listed.status == 200
            assert limit_headers(listed.headers)["x-ratelimit-remaining-tokens"] == "0"
        refused = await http_post(gateway, {"model": MODEL, "prompt": "hi", "max_tokens": 1})
        assert refused.status == 429 and limit_headers(refused.headers)["x-ratelimit-remaining-tokens"] == "0"
        code, _, trailing = await generate_over_grpc(gateway, model=MODEL, max_tokens=1)
        assert code is grpc.StatusCode.RESOURCE_EXHAUSTED
        assert limit_headers(trailing)["x-ratelimit-remaining-tokens"] == "0"


@pytest.fixture
async def unlimited_gateway(tmp_path):
    async with in_process_gateway(tmp_path) as gateway:
        yield gateway


async def http_post(gateway, body: dict, url: str = "/v1/completions"):
    headers = {"Authorization": f"Bearer {API_KEY}"}
    async with gateway.http.post(url, data=json.dumps(body), headers=headers) as response:
        await response.read()
        return response


def limit_headers(headers) -> dict:
    return {name: headers[name] for name in HEADERS if name in headers}


async def test_http_three_requests_show_2_1_0_then_a_429_with_retry_after_and_headers(limited_gateway):
    seen = []
    for _ in range(3):
        response = await http_post(limited_gateway, {"model": MODEL, "prompt": "hi", "max_tokens": 10})
        assert response.status == 503  # admitted, then no worker: an error after authentication
        seen.append(limit_headers(response.headers))
    assert [h["x-ratelimit-remaining-requests"] for h in seen] == ["2", "1", "0"]
    # Each reserved its max_tokens of output tokens and, failing, got them back when it ended.
    assert [h["x-ratelimit-remaining-tokens"] for h in seen] == ["90", "90", "90"]
    assert all(h["x-ratelimit-limit-requests"] == "3" and h["x-ratelimit-limit-tokens"] == "100" for h in seen)
    refused = await http_post(limited_gateway, {"model": MODEL, "prompt": "hi", "max_tokens": 10})
    assert refused.status == 429
    assert 1 <= int(refused.headers["Retry-After"]) <= 20
    headers = limit_headers(refused.headers)
    assert headers["x-ratelimit-remaining-requests"] == "0" and headers["x-ratelimit-remaining-tokens"] == "100"
    assert headers["x-ratelimit-reset-requests"].endswith("s")
    assert limited_gateway.path.runs == 3


async def test_http_errors_before_the_limits_carry_the_state_without_taking(limited_gateway):
    unknown_model = await http_post(limited_gateway, {"model": "no-such-model", "prompt": "hi"})
    assert unknown_model.status == 404
    assert limit_headers(unknown_model.headers)["x-ratelimit-remaining-requests"] == "3"
    async with limited_gateway.http.get("/v1/models", headers={"Authorization": f"Bearer {API_KEY}"}) as listed:
        assert listed.status == 200
        assert limit_headers(listed.headers)["x-ratelimit-remaining-requests"] == "3"
    url = "/v1/models/no-such-model"
    async with limited_gateway.http.get(url, headers={"Authorization": f"Bearer {API_KEY}"}) as missing:
        assert missing.status == 404 and limit_headers(missing.headers)["x-ratelimit-limit-requests"] == "3"


async def test_http_a_bad_key_gets_no_rate_limit_headers(limited_gateway):
    headers = {"Authorization": "Bearer dip_not_a_key"}
    async with limited_gateway.http.post("/v1/completions", json={"model": MODEL, "prompt": "x"}, headers=headers) as r:
        assert r.status == 401 and limit_headers(r.headers) == {}


async def test_http_an_unlimited_caller_gets_no_rate_limit_headers(unlimited_gateway):
    response = await http_post(unlimited_gateway, {"model": MODEL, "prompt": "hi"})
    assert response.status == 503 and limit_headers(response.headers) == {}


async def test_http_the_spend_limit_refusal_carries_the_headers(tmp_path):
    identity = {
        "limits": {"api_key": {"requests_per_minute": 3}},
        "spend": {"limit_micros": 0, "spent_micros": 5, "over_limit": True},
    }
    async with in_process_gateway(tmp_path, ControlPlaneInMemory(identity)) as gateway:
        response = await http_post(gateway, {"model": MODEL, "prompt": "hi"})
    assert response.status == 429 and limit_headers(response.headers)["x-ratelimit-remaining-requests"] == "3"


async def generate_over_grpc(gateway, **fields):
    """The Generate call's status, initial metadata and trailing metadata."""
    stub = inference_pb2_grpc.InferenceStub(gateway.channel)
    call = stub.Generate(inference_pb2.GenerateRequest(prompt="hi", **fields), metadata=AUTHORIZATION, timeout=10)
    try:
        async for _ in call:
            pass
    except grpc.aio.AioRpcError:
        pass
    return await call.code(), dict(await call.initial_metadata()), dict(await call.trailing_metadata())


async def test_grpc_carries_the_state_in_initial_and_trailing_metadata(limited_gateway):
    remaining = []
    for _ in range(3):
        code, initial, trailing = await generate_over_grpc(limited_gateway, model=MODEL, max_tokens=10)
        assert code is grpc.StatusCode.UNAVAILABLE
        assert limit_headers(initial) == limit_headers(trailing)  # told at the start, repeated with the error
        remaining.append(initial["x-ratelimit-remaining-requests"])
    assert remaining == ["2", "1", "0"]
    code, _, trailing = await generate_over_grpc(limited_gateway, model=MODEL, max_tokens=10)
    assert code is grpc.StatusCode.RESOURCE_EXHAUSTED
    assert 0 < int(trailing["retry-after-ms"]) <= 20_000
    assert limit_headers(trailing)["x-ratelimit-remaining-requests"] == "0"
    assert limit_headers(trailing)["x-ratelimit-remaining-tokens"] == "100"


async def test_grpc_errors_before_the_limits_and_list_models_carry_the_state(limited_gateway):
    code, _, trailing = await generate_over_grpc(limited_gateway, model="no-such-model")
    assert code is grpc.StatusCode.NOT_FOUND
    assert limit_headers(trailing)["x-ratelimit-remaining-requests"] == "3"
    call = inference_pb2_grpc.InferenceStub(limited_gateway.channel).ListModels(
        inference_pb2.ListModelsRequest(), metadata=AUTHORIZATION, timeout=10
    )
    await call
    assert limit_headers(dict(await call.initial_metadata()))["x-ratelimit-limit-tokens"] == "100"
