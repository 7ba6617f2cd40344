"""The admin sub-client's HTTP handling against a scripted loopback server (sdk_scripted_http.py)."""

from __future__ import annotations

from datetime import UTC, date, datetime

import pytest
from sdk_scripted_http import Reply, ScriptedHttp

import diptych

KEY = {
    "id": "key_1",
    "name": "ci",
    "prefix": "dip_ab12",
    "scopes": ["inference", "admin:read"],
    "created_at": "2026-11-20T10:00:00Z",
    "last_used_at": None,
    "expires_at": None,
    "revoked_at": None,
}
INVOICE = {
    "id": "inv_1",
    "period_start": "2026-10-01",
    "period_end": "2026-11-01",
    "status": "open",
    "currency": "usd",
    "total_cents": 1234,
    "stripe_invoice_id": "in_9",
    "lines": [
        {
            "model": "diptych-tiny",
            "phase": "decode",
            "tokens": 1000,
            "unit_price_micros_per_million": 2_000_000,
            "amount_micros": 2000,
        }
    ],
}


@pytest.fixture
def http():
    server = ScriptedHttp()
    yield server
    server.close()


@pytest.fixture
def client(http):
    with diptych.Client(api_key="dip_admin", admin_url=http.url, timeout=5, max_retries=2) as client:
        yield client


def test_api_keys_list_is_typed_and_authenticated(http, client):
    http.script = [Reply(body={"data": [KEY], "has_more": True, "total": 3})]
    page = client.admin.api_keys.list(limit=1, offset=0)
    assert page == diptych.Page(
        data=[
            diptych.ApiKey(
                id="key_1",
                name="ci",
                prefix="dip_ab12",
                scopes=["inference", "admin:read"],
                created_at=datetime(2026, 11, 20, 10, tzinfo=UTC),
                last_used_at=None,
                expires_at=None,
                revoked_at=None,
            )
        ],
        has_more=True,
        total=3,
    )
    (seen,) = http.seen
    assert (seen.method, seen.path) == ("GET", "/api/v1/api-keys?limit=1&offset=0")
    assert seen.headers["Authorization"] == "Bearer dip_admin"


def test_create_and_revoke_send_json(http, client):
    http.script = [
        Reply(status=201, body={**KEY, "key": "dip_secret"}),
        Reply(body={**KEY, "revoked_at": "2026-11-21T00:00:00+00:00"}),
    ]
    created = client.admin.api_keys.create(name="ci", scopes=["inference"])
    revoked = client.admin.api_keys.revoke(created.id)
    assert created.key == "dip_secret" and revoked.key is None and revoked.revoked_at is not None
    assert http.seen[0].body == {"name": "ci", "scopes": ["inference"], "expires_at": None}
    assert http.seen[0].headers["Content-Type"] == "application/json"
    assert (http.seen[1].method, http.seen[1].path) == ("POST", "/api/v1/api-keys/key_1/revoke")


def test_a_key_is_issued_in_a_project_and_names_it(http, client):
    http.script = [Reply(status=201, body={**KEY, "key": "dip_secret", "project_id": "proj_staging"})]
    created = client.admin.api_keys.create(name="ci", project_id="proj_staging")
    assert created.project_id == "proj_staging"
    assert http.seen[0].body == {"name": "ci", "expires_at": None, "project_id": "proj_staging"}


def test_usage_billing_invoices_and_spend_limit(http, client):
    http.script = [
        Reply(body={"data": [{"day": "2026-11-21", "key": "decode", "tokens": 7, "amount_micros": 14}]}),
        Reply(
            body={
                "period_start": "2026-11-01",
                "period_end": "2026-12-01",
                "currency": "usd",
                "amount_to_date_micros": 5,
                "projected_micros": 9,
                "spend_limit_micros": None,
                "alerts": [{"threshold_percent": 80, "triggered_at": "2026-11-21T01:02:03Z"}],
            }
        ),
        Reply(body={"data": [INVOICE], "has_more": False, "total": 1}),
        Reply(body={"limit_micros": 50_000_000}),
    ]
    (row,) = client.admin.usage.daily(start=date(2026, 11, 1), end="2026-11-21", group_by="phase")
    assert row == diptych.DailyUsage(day=date(2026, 11, 21), key="decode", tokens=7, amount_micros=14)
    billing = client.admin.billing.current()
    assert (billing.amount_to_date_micros, billing.projected_micros, billing.alerts[0].threshold_percent) == (5, 9, 80)
    invoice = client.admin.invoices.list().data[0]
    assert invoice.lines[0].amount_micros == 2000 and invoice.status == "open"
    assert client.admin.spend_limit.update(limit_micros=50_000_000) == diptych.SpendLimit(limit_micros=50_000_000)
    assert http.seen[0].path == "/api/v1/usage/daily?start=2026-11-01&end=2026-11-21&group_by=phase"
    assert (http.seen[3].method, http.seen[3].body) == ("PUT", {"limit_micros": 50_000_000})


@pytest.mark.parametrize(
    "call",
    [
        lambda admin: admin.usage.daily(start="2026-11-01", end="2026-11-02", group_by="region"),
        lambda admin: admin.usage.daily(start="November", end="2026-11-02"),
        lambda admin: admin.spend_limit.update(limit_micros=-1),
        lambda admin: admin.api_keys.revoke(""),
    ],
)
def test_bad_arguments_are_refused_before_sending(http, client, call):
    with pytest.raises(ValueError):
        call(client.admin)
    assert http.seen == []


@pytest.mark.parametrize(
    ("status", "error_class"),
    [
        (400, diptych.BadRequestError),
        (401, diptych.AuthenticationError),
        (403, diptych.PermissionDeniedError),
        (404, diptych.NotFoundError),
        (500, diptych.InternalServerError),
    ],
)
def test_http_errors_are_typed_and_not_retried(http, client, status, error_class):
    http.script = [Reply(status=status, body={"error": {"type": "nope", "message": "the server said no"}})]
    with pytest.raises(error_class, match="the server said no") as raised:
        client.admin.billing.current()
    assert (raised.value.status_code, raised.value.code) == (status, "nope")
    assert len(http.seen) == 1


def test_rate_limit_is_retried_after_the_servers_delay(http, client):
    http.script = [
        Reply(status=429, body={"error": {"type": "throttled", "message": "slow down"}}, headers={"Retry-After": "0"}),
        Reply(body={"data": [], "has_more": False, "total": 0}),
    ]
    assert client.admin.invoices.list().total == 0
    assert len(http.seen) == 2


def test_rate_limit_gives_up_after_max_retries(http, client):
    http.script = [
        Reply(
            status=429, body={"error": {"type": "throttled", "message": "slow down"}}, headers={"Retry-After": "0.01"}
        )
    ]
    with pytest.raises(diptych.RateLimitError) as raised:
        client.admin.invoices.list()
    assert raised.value.retry_after == 0.01 and len(http.seen) == 3


def test_dropped_connection_retries_a_get_and_a_keyed_post_but_never_a_put(http, client):
    http.script = [Reply(drop=True), Reply(body={"data": [], "has_more": False, "total": 0})]
    assert client.admin.api_keys.list().data == []
    assert len(http.seen) == 2 and "Idempotency-Key" not in http.seen[0].headers
    http.seen.clear()
    http.script = [Reply(drop=True), Reply(status=201, body={**KEY, "key": "dip_once"})]
    assert client.admin.api_keys.create(name="once").key == "dip_once"
    first, retry = http.seen
    assert first.headers["Idempotency-Key"] == retry.headers["Idempotency-Key"]
    assert first.headers["Idempotency-Key"].startswith("diptych-python-retry-")
    http.seen.clear()
    http.script = [Reply(drop=True), Reply(body={"limit_micros": 5})]
    with pytest.raises(diptych.APIConnectionError) as raised:
        client.admin.spend_limit.update(limit_micros=5)
    assert raised.value.code == "connection_lost" and len(http.seen) == 1
    assert "Idempotency-Key" not in http.seen[0].headers


def test_each_post_call_gets_its_own_idempotency_key(http, client):
    http.script = [Reply(status=201, body={**KEY, "key": "dip_secret"})]
    client.admin.api_keys.create(name="a")
    client.admin.api_keys.create(name="a")
    keys = [seen.headers["Idempotency-Key"] for seen in http.seen]
    assert len(keys) == 2 and keys[0] != keys[1]


@pytest.mark.parametrize(
    "reply",
    [
        Reply(raw=b"<html>proxy</html>"),
        Reply(body={"data": [{**KEY, "created_at": "yesterday"}], "has_more": False, "total": 1}),
        Reply(body={"data": [KEY], "has_more": False}),
        Reply(body={"data": [{**KEY, "scopes": "inference"}], "has_more": False, "total": 1}),
    ],
    ids=["not json", "bad time", "missing field", "wrong type"],
)
def test_answers_that_break_the_contract(http, client, reply):
    http.script = [reply]
    with pytest.raises(diptych.APIResponseValidationError):
        client.admin.api_keys.list()


def test_unreachable_admin_api(closed_port):
    with (
        diptych.Client(api_key="k", admin_url=f"http://127.0.0.1:{closed_port}", max_retries=1) as client,
        pytest.raises(diptych.APIConnectionError) as raised,
    ):
        client.admin.billing.current()
    assert raised.value.code == "connection_error" and type(raised.value) is diptych.APIConnectionError


async def test_async_admin(http):
    http.script = [Reply(body={"data": [KEY], "has_more": False, "total": 1}), Reply(body=INVOICE)]
    async with diptych.AsyncClient(api_key="dip_admin", admin_url=http.url) as client:
        page = await client.admin.api_keys.list()
        invoice = await client.admin.invoices.retrieve("inv_1")
    assert page.data[0].id == "key_1" and invoice.total_cents == 1234
    assert http.seen[1].path == "/api/v1/invoices/inv_1"
