"""Rate limits users can see, on the live stack (real workers): limits set through the control plane's REST
API and the SDK, the x-ratelimit-* headers (HTTP) and metadata (gRPC, through the SDK) on successes,
streams and 429s, with the buckets in process and in Redis, and a lowered limit reaching the gateway."""

import os
import time

import httpx
import pytest

import diptych
from tests.e2e.conftest import free_port
from tests.e2e.waiting import wait_for

MODEL = "diptych-tiny"
REDIS_URL = os.environ.get("REDIS_URL", "redis://127.0.0.1:6379/0")
BODY = {"model": MODEL, "prompt": "limits", "max_tokens": 2, "temperature": 0}


def admin_client(live, api_key: str | None = None) -> diptych.Client:
    return diptych.Client(
        api_key=api_key or live.api_key, base_url=live.gateways["split"], admin_url=live.stack.control_plane_url
    )


def limited_key(live, scopes=("inference",), **limits) -> diptych.ApiKey:
    """A fresh key (so no gateway has it cached) with `limits` set through the SDK's admin API."""
    with admin_client(live) as client:
        key = client.admin.api_keys.create(name=f"limits-{time.time_ns()}", scopes=list(scopes))
        if limits:
            changed = client.admin.limits.update_key(key.id, **limits)
            assert {name: getattr(changed, name) for name in limits} == limits
    return key


def post(http_url: str, key: str, **extra) -> httpx.Response:
    return httpx.post(
        f"{http_url}/completions", headers={"Authorization": f"Bearer {key}"}, json={**BODY, **extra}, timeout=30
    )


def remaining_requests_over_http(http_url: str, key: str) -> list[str]:
    """Three requests (whole, streamed, whole): each one's x-ratelimit-remaining-requests."""
    seen = []
    for stream in (False, True, False):
        with httpx.stream(
            "POST",
            f"{http_url}/completions",
            headers={"Authorization": f"Bearer {key}"},
            json={**BODY, "stream": stream},
            timeout=30,
        ) as response:
            body = response.read().decode()
            assert response.status_code == 200, body
            assert ("data: [DONE]" in body) is stream
            assert response.headers["x-ratelimit-limit-requests"] == "3"
            assert "x-ratelimit-limit-tokens" in response.headers  # the organization's default token limits
            seen.append(response.headers["x-ratelimit-remaining-requests"])
    return seen


def assert_refused_with_headers(http_url: str, key: str) -> None:
    refused = post(http_url, key)
    assert refused.status_code == 429, refused.text
    assert 1 <= int(refused.headers["Retry-After"]) <= 20  # one request comes back every 20 s at 3 a minute
    assert refused.headers["x-ratelimit-remaining-requests"] == "0"
    assert refused.headers["x-ratelimit-limit-requests"] == "3"
    assert refused.headers["x-ratelimit-reset-requests"].endswith("s")


def test_the_demo_key_without_limits_of_its_own_gets_every_header_from_its_organizations_defaults(live):
    response = post(live.http_urls["split"], live.api_key)
    assert response.status_code == 200, response.text
    assert response.headers["x-ratelimit-limit-requests"] == "500"
    assert response.headers["x-ratelimit-limit-tokens"] == "200000"
    for family in ("requests", "tokens"):
        assert int(response.headers[f"x-ratelimit-remaining-{family}"]) > 0
        assert response.headers[f"x-ratelimit-reset-{family}"].endswith("s")
    with diptych.Client(api_key=live.api_key, base_url=live.gateways["split"], max_retries=0) as client:
        limits = client.completions.create(model=MODEL, prompt="limits", max_tokens=2, temperature=0).rate_limits
    assert limits is not None and (limits.limit_requests, limits.limit_tokens) == (500, 200_000)


def test_http_three_requests_show_2_1_0_then_a_429_with_the_headers(live):
    key = limited_key(live, requests_per_minute=3).key
    assert remaining_requests_over_http(live.http_urls["split"], key) == ["2", "1", "0"]
    assert_refused_with_headers(live.http_urls["split"], key)


def test_the_same_with_the_buckets_in_redis(live):
    import redis

    try:
        redis.Redis.from_url(REDIS_URL, socket_connect_timeout=0.5).ping()
    except redis.RedisError:
        pytest.skip(f"no Redis at {REDIS_URL}")
    key = limited_key(live, requests_per_minute=3)
    http_port = free_port()
    live.stack.start_gateway(
        "gateway-redis-headers", free_port(), free_port(), "colocated", http_port=http_port, REDIS_URL=REDIS_URL
    )
    try:
        http_url = f"http://127.0.0.1:{http_port}/v1"
        assert remaining_requests_over_http(http_url, key.key) == ["2", "1", "0"]
        assert_refused_with_headers(http_url, key.key)
        assert redis.Redis.from_url(REDIS_URL).exists(f"diptych:rl:key:{key.id}:requests")
    finally:
        live.stack.stop_process("gateway-redis-headers")


@pytest.mark.parametrize("mode", ["split", "colocated"])
def test_the_sdk_shows_the_grpc_metadata_on_completions_streams_and_errors(live, mode):
    key = limited_key(live, requests_per_minute=3, output_tokens_per_minute=50).key
    with diptych.Client(api_key=key, base_url=live.gateways[mode], max_retries=0) as client:
        completion = client.completions.create(model=MODEL, prompt="limits", max_tokens=4, temperature=0)
        assert completion.rate_limits is not None
        assert (completion.rate_limits.limit_requests, completion.rate_limits.remaining_requests) == (3, 2)
        # The key's output tokens' bucket is the tightest (the organization's default limits are far wider):
        # 4 of 50 reserved by this request.
        assert (completion.rate_limits.limit_tokens, completion.rate_limits.remaining_tokens) == (50, 46)
        assert 0 < completion.rate_limits.reset_requests <= 60
        with client.completions.create(model=MODEL, prompt="limits", max_tokens=4, stream=True) as stream:
            assert stream.rate_limits is not None and stream.rate_limits.remaining_requests == 1
            assert [chunk for chunk in stream][-1].finish_reason is not None
        client.completions.create(model=MODEL, prompt="limits", max_tokens=4)
        with pytest.raises(diptych.RateLimitError) as raised:
            client.completions.create(model=MODEL, prompt="limits", max_tokens=4)
    refused = raised.value
    assert refused.retry_after is not None and 0 < refused.retry_after <= 20
    assert refused.rate_limits is not None and refused.rate_limits.remaining_requests == 0


def test_a_lowered_limit_reaches_the_gateway_within_the_key_cache_time(live):
    key = limited_key(live, requests_per_minute=100)
    http_url = live.http_urls["split"]
    assert post(http_url, key.key).headers["x-ratelimit-limit-requests"] == "100"  # now cached by the gateway
    with admin_client(live) as client:
        client.admin.limits.update_key(key.id, requests_per_minute=2)
    # The gateway's key cache holds a key's answer 5 s.
    assert wait_for(lambda: post(http_url, key.key).headers["x-ratelimit-limit-requests"] == "2", seconds=10)
    refused = wait_for(lambda: post(http_url, key.key).status_code == 429, seconds=5)
    assert refused, "a key lowered to 2 requests a minute was not refused"


def test_the_sdk_limits_admin_api_reads_sets_and_maps_errors(live):
    with admin_client(live) as client:
        before = client.admin.limits.retrieve()
        assert before.organization_id == live.credentials.organization_id
        changed = client.admin.limits.update(input_tokens_per_minute=1_000_000)
        assert changed.input_tokens_per_minute == 1_000_000
        assert changed.requests_per_minute == before.requests_per_minute  # left as it was
        assert client.admin.limits.update(input_tokens_per_minute=None).input_tokens_per_minute is None
        key = limited_key(live, output_tokens_per_minute=77)
        assert client.admin.limits.retrieve_key(key.id).output_tokens_per_minute == 77
        assert [k for k in client.admin.api_keys.list(limit=100).data if k.id == key.id]
        with pytest.raises(diptych.BadRequestError) as raised:
            client.admin.limits.update_key(key.id, requests_per_minute=2**31)
        assert raised.value.status_code == 400 and "requests_per_minute" in raised.value.message
        with pytest.raises(diptych.NotFoundError):
            client.admin.limits.retrieve_key("key_doesnotexist")
        with pytest.raises(ValueError, match="requests_per_minute must be a non-negative integer"):
            client.admin.limits.update(requests_per_minute=-1)
        with pytest.raises(ValueError, match="give at least one of"):
            client.admin.limits.update()
    reader = limited_key(live, scopes=("inference", "admin:read"))
    with admin_client(live, reader.key) as client:
        assert client.admin.limits.retrieve().organization_id == live.credentials.organization_id
        with pytest.raises(diptych.PermissionDeniedError) as denied:
            client.admin.limits.update(requests_per_minute=1)
        assert "limits:write" in denied.value.message
        assert client.admin.limits.retrieve().requests_per_minute == before.requests_per_minute
