"""A project's limits at the gateway: read from the control plane's verify answer, applied beside the key's
and the organization's (the tightest refuses), reported in the x-ratelimit-* headers, and counted as the
project's refusals; a project over its spend limit is refused."""

import uuid

import pytest

from gateway.accounts.auth import Caller, RateLimits, Spend, caller_from_identity, check_allowed
from gateway.accounts.limits import RateLimited, RateLimiter
from gateway.accounts.ratelimit_headers import rate_limit_metadata
from gateway.types import ErrorKind, GatewayError
from tests.gateway.harness import API_KEY, MODEL, ControlPlaneInMemory, in_process_gateway
from tests.gateway.test_limits import REDIS_URL, redis_reachable
from tests.gateway.test_ratelimit_headers import http_post, limit_headers


@pytest.fixture(params=["in-process", "redis"])
async def limiter(request):
    if request.param == "redis" and not redis_reachable():
        pytest.skip(f"no Redis at {REDIS_URL}")
    limiter = RateLimiter(REDIS_URL if request.param == "redis" else None)
    yield limiter
    await limiter.close()


def caller(
    project_id: str, *, project: RateLimits, key: RateLimits | None = None, org: RateLimits | None = None
) -> Caller:
    return Caller(
        uuid.uuid4().hex,
        uuid.uuid4().hex,
        organization_limits=org or RateLimits(),
        key_limits=key or RateLimits(),
        project_id=project_id,
        project_limits=project,
    )


def test_the_project_its_limits_and_its_spend_are_read_from_the_verify_answer():
    verified = caller_from_identity(
        {
            "api_key_id": "key_1",
            "organization_id": "org_1",
            "project_id": "proj_1",
            "limits": {"project": {"requests_per_minute": 7, "output_tokens_per_minute": None}},
            "project_spend": {"limit_micros": 10, "spent_micros": 4, "over_limit": False},
        }
    )
    assert verified.project_id == "proj_1"
    assert verified.project_limits == RateLimits(requests_per_minute=7)
    assert verified.project_spend == Spend(limit_micros=10, spent_micros=4, over_limit=False)
    older = caller_from_identity({"api_key_id": "key_1", "organization_id": "org_1"})
    assert (older.project_id, older.project_limits, older.project_spend) == ("", RateLimits(), Spend())


async def test_a_projects_limit_applies_across_its_keys_and_the_tightest_limit_refuses(limiter):
    project_id = uuid.uuid4().hex
    first = caller(project_id, project=RateLimits(requests_per_minute=2), key=RateLimits(requests_per_minute=5))
    second = caller(project_id, project=RateLimits(requests_per_minute=2), org=RateLimits(requests_per_minute=10))
    await limiter.admit(first, input_tokens=1, max_output_tokens=1)
    await limiter.admit(second, input_tokens=1, max_output_tokens=1)
    with pytest.raises(RateLimited) as raised:
        await limiter.admit(first, input_tokens=1, max_output_tokens=1)
    assert "the project limit of 2 requests per minute" in raised.value.message
    other_project = caller(uuid.uuid4().hex, project=RateLimits(requests_per_minute=2))
    await limiter.admit(other_project, input_tokens=1, max_output_tokens=1)


async def test_a_key_tighter_than_its_project_refuses_first(limiter):
    who = caller(
        uuid.uuid4().hex, project=RateLimits(input_tokens_per_minute=100), key=RateLimits(input_tokens_per_minute=50)
    )
    with pytest.raises(RateLimited) as raised:
        await limiter.admit(who, input_tokens=60, max_output_tokens=1)
    assert "API key limit is 50 input tokens" in raised.value.message


async def test_the_headers_report_the_project_bucket_when_it_is_the_tightest(limiter):
    who = caller(uuid.uuid4().hex, project=RateLimits(requests_per_minute=3), key=RateLimits(requests_per_minute=30))
    reservation = await limiter.admit(who, input_tokens=1, max_output_tokens=1)
    headers = dict(rate_limit_metadata(reservation.states))
    assert (headers["x-ratelimit-limit-requests"], headers["x-ratelimit-remaining-requests"]) == ("3", "2")
    assert {state.scope for state in reservation.states} == {"project", "API key"}


async def test_a_project_refusal_is_counted_as_the_projects():
    limiter = RateLimiter()
    who = caller(uuid.uuid4().hex, project=RateLimits(requests_per_minute=0))
    with pytest.raises(RateLimited):
        await limiter.admit(who, input_tokens=1, max_output_tokens=1)
    [row] = limiter.refusals.take()
    assert (row.api_key_id, row.scope, row.limit, row.limit_value) == (
        who.api_key_id,
        "project",
        "requests_per_minute",
        0,
    )


async def test_project_limits_without_a_project_id_share_no_bucket():
    limiter = RateLimiter()
    who = caller("", project=RateLimits(requests_per_minute=0))
    await limiter.admit(who, input_tokens=1, max_output_tokens=1)


def test_a_project_over_its_spend_limit_is_refused_with_the_amount():
    who = Caller("org_1", "key_1", project_id="proj_1", project_spend=Spend(limit_micros=2_500_000, over_limit=True))
    with pytest.raises(GatewayError) as raised:
        check_allowed(who)
    assert raised.value.kind is ErrorKind.RESOURCE_EXHAUSTED
    assert raised.value.message.startswith("spend limit of $2.50 reached by project proj_1")
    check_allowed(Caller("org_1", "key_1", project_id="proj_1", project_spend=Spend(limit_micros=2_500_000)))


async def test_http_answers_carry_the_projects_limit_and_refuse_past_it(tmp_path):
    identity = {
        "project_id": "proj_1",
        "limits": {"project": {"requests_per_minute": 2}, "api_key": {"requests_per_minute": 50}},
    }
    async with in_process_gateway(tmp_path, ControlPlaneInMemory(identity)) as gateway:
        seen = [await http_post(gateway, {"model": MODEL, "prompt": "hi", "max_tokens": 1}) for _ in range(3)]
    assert [response.status for response in seen] == [503, 503, 429]
    assert [limit_headers(r.headers)["x-ratelimit-remaining-requests"] for r in seen] == ["1", "0", "0"]
    assert all(limit_headers(r.headers)["x-ratelimit-limit-requests"] == "2" for r in seen)


async def test_http_a_project_over_its_spend_limit_gets_insufficient_quota(tmp_path):
    identity = {"project_id": "proj_1", "project_spend": {"limit_micros": 0, "spent_micros": 5, "over_limit": True}}
    async with in_process_gateway(tmp_path, ControlPlaneInMemory(identity)) as gateway:
        headers = {"Authorization": f"Bearer {API_KEY}"}
        async with gateway.http.post("/v1/completions", json={"model": MODEL, "prompt": "hi"}, headers=headers) as r:
            status, body = r.status, await r.json()
    assert status == 429 and body["error"]["code"] == "insufficient_quota"
    assert "project proj_1" in body["error"]["message"]
