"""Rate limits: token buckets per organization and API key, in process and in Redis (one Lua script)."""

import asyncio
import os
import uuid

import pytest

from gateway.accounts.auth import Caller, RateLimits
from gateway.accounts.limits import RateLimiter
from gateway.types import ErrorKind, GatewayError

REDIS_URL = os.environ.get("REDIS_URL", "redis://127.0.0.1:6379/0")


def redis_reachable() -> bool:
    import redis

    try:
        return redis.Redis.from_url(REDIS_URL, socket_connect_timeout=0.5).ping()
    except redis.RedisError:
        return False


@pytest.fixture(params=["in-process", "redis"])
async def limiter(request):
    if request.param == "redis":
        if not redis_reachable():
            pytest.skip(f"no Redis at {REDIS_URL}")
        limiter = RateLimiter(REDIS_URL)
    else:
        limiter = RateLimiter()
    yield limiter
    await limiter.close()


def caller(org: RateLimits | None = None, key: RateLimits | None = None) -> Caller:
    # Fresh ids: Redis buckets of earlier runs never interfere.
    return Caller(
        uuid.uuid4().hex, uuid.uuid4().hex, organization_limits=org or RateLimits(), key_limits=key or RateLimits()
    )


async def test_requests_per_minute_refuses_the_next_request_with_the_time_to_retry(limiter):
    who = caller(key=RateLimits(requests_per_minute=3))
    for _ in range(3):
        await limiter.admit(who, input_tokens=5, max_output_tokens=5)
    with pytest.raises(GatewayError) as raised:
        await limiter.admit(who, input_tokens=5, max_output_tokens=5)
    error = raised.value
    assert error.kind is ErrorKind.RESOURCE_EXHAUSTED
    # One request comes back every 20 s at 3 per minute.
    assert 15_000 < error.retry_after_ms <= 20_000
    assert "API key limit of 3 requests per minute" in error.message
    assert f"retry after {error.retry_after_ms} ms" in error.message


async def test_organization_limits_apply_across_its_keys(limiter):
    first = caller(org=RateLimits(input_tokens_per_minute=100))
    second = Caller(first.organization_id, uuid.uuid4().hex, organization_limits=first.organization_limits)
    await limiter.admit(first, input_tokens=60, max_output_tokens=1)
    with pytest.raises(GatewayError) as raised:
        await limiter.admit(second, input_tokens=60, max_output_tokens=1)
    assert "organization limit of 100 input tokens per minute" in raised.value.message
    await limiter.admit(second, input_tokens=40, max_output_tokens=1)


async def test_a_refused_request_takes_nothing_from_any_bucket(limiter):
    who = caller(key=RateLimits(requests_per_minute=10, output_tokens_per_minute=100))
    await limiter.admit(who, input_tokens=1, max_output_tokens=90)
    for _ in range(5):
        with pytest.raises(GatewayError):
            await limiter.admit(who, input_tokens=1, max_output_tokens=50)
    # The five refusals did not spend requests: 9 of 10 are left, each asking for a single output token
    # (the refill over the test's few milliseconds adds well under one request).
    for _ in range(9):
        await limiter.admit(who, input_tokens=1, max_output_tokens=1)


async def test_unused_output_tokens_are_refunded(limiter):
    who = caller(key=RateLimits(output_tokens_per_minute=100))
    reservation = await limiter.admit(who, input_tokens=1, max_output_tokens=80)
    with pytest.raises(GatewayError):
        await limiter.admit(who, input_tokens=1, max_output_tokens=80)
    await limiter.settle(reservation, output_tokens=10)  # 70 come back
    await limiter.admit(who, input_tokens=1, max_output_tokens=80)


async def test_a_request_larger_than_a_whole_minute_is_refused_without_a_retry_time(limiter):
    who = caller(key=RateLimits(input_tokens_per_minute=50))
    with pytest.raises(GatewayError) as raised:
        await limiter.admit(who, input_tokens=51, max_output_tokens=1)
    assert raised.value.retry_after_ms is None
    assert "needs 51 input tokens" in raised.value.message and "shorten the prompt" in raised.value.message


async def test_no_limits_means_unlimited(limiter):
    who = caller()
    for _ in range(50):
        await limiter.admit(who, input_tokens=10_000, max_output_tokens=10_000)


async def test_concurrent_admissions_never_overrun_a_limit(limiter):
    who = caller(key=RateLimits(requests_per_minute=7))

    async def attempt() -> bool:
        try:
            await limiter.admit(who, input_tokens=1, max_output_tokens=1)
            return True
        except GatewayError:
            return False

    results = await asyncio.gather(*(attempt() for _ in range(40)))
    assert sum(results) == 7


async def test_two_gateways_share_the_redis_buckets():
    if not redis_reachable():
        pytest.skip(f"no Redis at {REDIS_URL}")
    first, second = RateLimiter(REDIS_URL), RateLimiter(REDIS_URL)
    who = caller(org=RateLimits(requests_per_minute=2))
    try:
        await first.admit(who, 1, 1)
        await second.admit(who, 1, 1)
        with pytest.raises(GatewayError):
            await first.admit(who, 1, 1)
        with pytest.raises(GatewayError):
            await second.admit(who, 1, 1)
    finally:
        await first.close()
        await second.close()
