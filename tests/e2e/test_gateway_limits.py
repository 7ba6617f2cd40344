"""Limits the gateway enforces from what the control plane says of a key: rate limits (in process and in
Redis), the organization's spend cap, and the key's scopes; over gRPC and over the HTTP API."""

import os
import time

import grpc
import httpx
import openai
import pytest

from diptych_proto.v1 import inference_pb2, inference_pb2_grpc
from tests.e2e.conftest import free_port
from tests.e2e.waiting import wait_for

MODEL = "diptych-tiny"
REDIS_URL = os.environ.get("REDIS_URL", "redis://127.0.0.1:6379/0")


def new_key(live, scopes=("inference",), **limits) -> dict:
    with live.rest() as rest:
        response = rest.post("/api-keys", json={"name": f"limits-{time.time_ns()}", "scopes": list(scopes)})
    assert response.status_code == 201, response.text
    created = response.json()
    if limits:
        assignments = ", ".join(f"{name}={value}" for name, value in limits.items())
        live.stack._manage(
            "shell",
            "-c",
            "from controlplane.tenancy.models import ApiKey; "
            f"ApiKey.objects.filter(public_id={created['id']!r}).update({assignments})",
        )
    return created


def generate(gateway: str, key: str, max_tokens: int = 2):
    """Runs one request on the raw gRPC stub; returns None or the error with its trailing metadata."""
    with grpc.insecure_channel(gateway.removeprefix("grpc://")) as channel:
        call = inference_pb2_grpc.InferenceStub(channel).Generate(
            inference_pb2.GenerateRequest(model=MODEL, prompt="limits", max_tokens=max_tokens, temperature=0),
            metadata=(("authorization", f"Bearer {key}"),),
            timeout=30,
        )
        try:
            for _ in call:
                pass
        except grpc.RpcError as error:
            return error
    return None


def test_requests_per_minute_per_key_over_grpc_and_http(live):
    key = new_key(live, requests_per_minute=2)["key"]
    assert generate(live.gateways["split"], key) is None
    assert generate(live.gateways["split"], key) is None
    refused = generate(live.gateways["split"], key)
    assert refused.code() is grpc.StatusCode.RESOURCE_EXHAUSTED
    retry_after_ms = int(dict(refused.trailing_metadata())["retry-after-ms"])
    assert 0 < retry_after_ms <= 30_000  # one request comes back every 30 s at 2 per minute
    assert "API key limit of 2 requests per minute" in refused.details() and "retry after" in refused.details()
    with (
        openai.OpenAI(api_key=key, base_url=live.http_urls["split"], max_retries=0) as client,
        pytest.raises(openai.RateLimitError) as raised,
    ):
        client.completions.create(model=MODEL, prompt="limits", max_tokens=2)
    response = raised.value.response
    assert 1 <= int(response.headers["Retry-After"]) <= 30
    assert raised.value.body["type"] == "rate_limit_error" and raised.value.body["code"] == "rate_limit_exceeded"


def test_output_tokens_are_reserved_up_front(live):
    key = new_key(live, output_tokens_per_minute=10)["key"]
    refused = generate(live.gateways["split"], key, max_tokens=11)
    assert refused.code() is grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "needs 11 output tokens" in refused.details() and "lower max_tokens" in refused.details()
    assert generate(live.gateways["split"], key, max_tokens=8) is None
    assert generate(live.gateways["split"], key, max_tokens=8).code() is grpc.StatusCode.RESOURCE_EXHAUSTED


def test_limits_in_redis(live):
    """A gateway with REDIS_URL keeps the buckets in Redis (tests/gateway/test_limits.py shows two
    limiters sharing them)."""
    import redis

    try:
        redis.Redis.from_url(REDIS_URL, socket_connect_timeout=0.5).ping()
    except redis.RedisError:
        pytest.skip(f"no Redis at {REDIS_URL}")
    created = new_key(live, requests_per_minute=2)
    port = free_port()
    live.stack.start_gateway("gateway-redis", port, free_port(), "split", http_port=free_port(), REDIS_URL=REDIS_URL)
    try:
        gateway = f"127.0.0.1:{port}"
        assert generate(gateway, created["key"]) is None
        assert generate(gateway, created["key"]) is None
        refused = generate(gateway, created["key"])
        assert refused.code() is grpc.StatusCode.RESOURCE_EXHAUSTED
        assert 0 < int(dict(refused.trailing_metadata())["retry-after-ms"]) <= 30_000
        assert redis.Redis.from_url(REDIS_URL).exists(f"diptych:rl:key:{created['id']}:requests")
    finally:
        live.stack.stop_process("gateway-redis")


def test_a_key_without_the_inference_scope_is_refused(live):
    key = new_key(live, scopes=("admin:read",))["key"]
    refused = generate(live.gateways["split"], key)
    assert refused.code() is grpc.StatusCode.PERMISSION_DENIED
    assert "lacks the 'inference' scope" in refused.details()
    response = httpx.post(
        f"{live.http_urls['split']}/completions",
        headers={"Authorization": f"Bearer {key}"},
        json={"model": MODEL, "prompt": "x"},
        timeout=10,
    )
    assert response.status_code == 403 and response.json()["error"]["type"] == "permission_error"


def test_an_organization_over_its_spend_cap_is_refused_until_the_cap_is_raised(live):
    key = new_key(live)["key"]  # a key of the demo organization, fresh in the gateway's cache
    with live.rest() as rest:
        assert rest.put("/spend-limit", json={"limit_micros": 0}).status_code == 200
    try:
        refused = generate(live.gateways["split"], key)
        assert refused.code() is grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "spend limit of $0.00 reached for this billing period" in refused.details()
        response = httpx.post(
            f"{live.http_urls['split']}/completions",
            headers={"Authorization": f"Bearer {key}"},
            json={"model": MODEL, "prompt": "x"},
            timeout=10,
        )
        assert response.status_code == 429 and response.json()["error"]["code"] == "insufficient_quota"
    finally:
        with live.rest() as rest:
            assert rest.put("/spend-limit", json={"limit_micros": None}).status_code == 200
    # Within the gateway's key cache time (5 s) the organization may spend again.
    for gateway in live.gateways.values():
        for api_key in (key, live.api_key):
            served = wait_for(lambda g=gateway, k=api_key: generate(g, k) is None, seconds=10, interval=0.25)
            assert served, "still refused 10 s after the cap was lifted"
