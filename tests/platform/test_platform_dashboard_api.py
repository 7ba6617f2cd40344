"""What the dashboard asks the control plane beyond usage and billing: batches' runner keys kept out of the key
lists (and still listed when asked for), requests per key, the gateways' refusals by a rate limit, and the
browser's session without an error before sign-in."""

from datetime import UTC, datetime, timedelta

import pytest
from rest_framework.test import APIClient

from controlplane.batches.services import batch_create, file_upload
from controlplane.billing.tasks import roll_up_usage
from controlplane.metering.models import RateLimitRefusal
from controlplane.tenancy.models import ApiKeyKind
from controlplane.tenancy.services import IssuedApiKey, member_add, user_ensure

REFUSALS_URL = "/api/v1/internal/rate-limit-refusals"
LINE = b'{"custom_id": "a", "method": "POST", "url": "/v1/chat/completions", "body": {"model": "diptych-tiny", "messages": [{"role": "user", "content": "hi"}]}}\n'  # noqa: E501


@pytest.fixture
def batch_a(org_a, tiny_model):
    file = file_upload(organization=org_a, filename="in.jsonl", purpose="batch", content=LINE)
    return batch_create(
        organization=org_a, input_file_id=file.public_id, endpoint="/v1/chat/completions", completion_window="24h"
    )


def test_a_batchs_runner_key_is_listed_only_when_asked_for(client_a, key_a, batch_a):
    assert batch_a.runner_key.kind == ApiKeyKind.BATCH_RUNNER
    listed = client_a.get("/api/v1/api-keys").json()["data"]
    assert [key["id"] for key in listed] == [key_a.api_key.public_id]
    assert listed[0]["kind"] == "standard"
    runners = client_a.get("/api/v1/api-keys", {"kind": "batch_runner"}).json()["data"]
    assert [(key["id"], key["kind"]) for key in runners] == [(batch_a.runner_key.public_id, "batch_runner")]
    every = client_a.get("/api/v1/api-keys", {"kind": "all"}).json()["data"]
    assert {key["id"] for key in every} == {key_a.api_key.public_id, batch_a.runner_key.public_id}
    assert client_a.get(f"/api/v1/api-keys/{batch_a.runner_key.public_id}").status_code == 200  # still auditable
    assert client_a.get("/api/v1/api-keys", {"kind": "nonsense"}).status_code == 400


def test_usage_daily_by_key_kind(client_a, internal_client, key_a, batch_a, make_usage_event):
    runner = IssuedApiKey(batch_a.runner_key, "")
    events = [make_usage_event(key_a, "req-1"), make_usage_event(runner, "req-2", tier="batch")]
    assert internal_client.post("/api/v1/internal/usage-events", {"events": events}).status_code == 200
    roll_up_usage()
    day = events[0]["started_at"][:10]
    query = {"start": day, "end": day, "group_by": "api_key"}
    mine = client_a.get("/api/v1/usage/daily", {**query, "api_key_kind": "standard"}).json()["data"]
    batches = client_a.get("/api/v1/usage/daily", {**query, "api_key_kind": "batch_runner"}).json()["data"]
    assert [row["key"] for row in mine] == [key_a.api_key.public_id]
    assert [row["key"] for row in batches] == [batch_a.runner_key.public_id]
    requests = client_a.get("/api/v1/usage/requests", {"start": day, "end": day, "api_key_kind": "standard"})
    assert [row["key"] for row in requests.json()["data"]] == [key_a.api_key.public_id]


def test_requests_per_key_and_day_count_each_request_once(client_a, internal_client, key_a, make_usage_event):
    events = [
        make_usage_event(key_a, "req-1", "prefill"),
        make_usage_event(key_a, "req-1", "decode", cached_tokens=0),
        make_usage_event(key_a, "req-2", "prefill"),
    ]
    assert internal_client.post("/api/v1/internal/usage-events", {"events": events}).status_code == 200
    day = events[0]["started_at"][:10]
    answer = client_a.get("/api/v1/usage/requests", {"start": day, "end": day})
    assert answer.status_code == 200
    assert answer.json()["data"] == [{"day": day, "key": key_a.api_key.public_id, "requests": 2}]
    by_model = client_a.get("/api/v1/usage/requests", {"start": day, "end": day, "group_by": "model"}).json()
    assert by_model["data"] == [{"day": day, "key": "diptych-tiny", "requests": 2}]
    too_long = client_a.get("/api/v1/usage/requests", {"start": "2020-01-01", "end": "2022-01-01"})
    assert too_long.status_code == 400


def refusal(issued, minute: datetime, **overrides) -> dict:
    row = {
        "id": f"r{minute:%H%M}{overrides.get('limit', 'rpm')[:3]}" + "0" * 8,
        "organization_id": issued.api_key.organization.public_id,
        "api_key_id": issued.api_key.public_id,
        "scope": "api_key",
        "limit": "requests_per_minute",
        "limit_value": 3,
        "minute": minute.isoformat(),
        "refusals": 4,
    }
    return {**row, **overrides}


def test_refusals_reported_by_the_gateway_show_by_day_key_and_limit(
    mid_period_clock, client_a, client_b, internal_client, key_a
):
    now = mid_period_clock.replace(second=0, microsecond=0)
    earlier = now - timedelta(minutes=2)  # the same day: in a day's first two minutes it would be the one before
    batch = [
        refusal(key_a, earlier, refusals=2),
        refusal(key_a, now, refusals=5),
        refusal(key_a, now, id="other-limit-row", scope="organization", limit="output_tokens_per_minute"),
    ]
    first = internal_client.post(REFUSALS_URL, {"refusals": batch}, format="json")
    assert first.status_code == 200 and first.json() == {"accepted": 3, "duplicates": 0}
    again = internal_client.post(REFUSALS_URL, {"refusals": batch}, format="json")  # a lost answer, sent again
    assert again.json() == {"accepted": 0, "duplicates": 3}
    assert RateLimitRefusal.objects.count() == 3

    day = now.date().isoformat()
    rows = client_a.get("/api/v1/rate-limit-refusals", {"start": day, "end": day}).json()["data"]
    by_limit = {(row["scope"], row["limit"]): row for row in rows}
    requests = by_limit[("api_key", "requests_per_minute")]
    assert (requests["refusals"], requests["limit_value"], requests["api_key_name"]) == (7, 3, key_a.api_key.name)
    assert requests["last_refused_at"].replace("Z", "+00:00") == now.isoformat()
    assert by_limit[("organization", "output_tokens_per_minute")]["refusals"] == 4
    assert client_b.get("/api/v1/rate-limit-refusals", {"start": day, "end": day}).json()["data"] == []


def test_a_refusal_of_another_organizations_key_is_refused_whole(internal_client, key_a, key_b):
    mismatched = refusal(key_a, datetime.now(UTC), organization_id=key_b.api_key.organization.public_id)
    answer = internal_client.post(REFUSALS_URL, {"refusals": [mismatched]}, format="json")
    assert answer.status_code == 400 and "refusals[0].api_key_id" in answer.json()["error"]["fields"]
    assert not RateLimitRefusal.objects.exists()


def test_the_session_answers_before_sign_in_without_an_error(org_a):
    browser = APIClient()
    before = browser.get("/api/v1/auth/session")
    assert before.status_code == 200 and before.json() == {"signed_in": False, "user": None}
    assert "csrftoken" in before.cookies
    user = user_ensure(email="owner@acme.test", password="pw-for-tests-1")
    member_add(organization=org_a, email="owner@acme.test", role="owner")
    browser.force_login(user)
    after = browser.get("/api/v1/auth/session").json()
    assert after["signed_in"] is True
    assert after["user"] == {
        "email": "owner@acme.test",
        "is_staff": False,
        "organization": {"id": org_a.public_id, "name": org_a.name},
        "role": "owner",
    }
