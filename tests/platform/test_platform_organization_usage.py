"""OpenAI's organization usage and costs endpoints: /api/v1/organization/usage/completions and
/api/v1/organization/costs, in OpenAI's shapes, answered from the ledger and its daily rollup; costs add up to
the cent to what usage/daily says for the same days; and the gateway serves both to the official client."""

from datetime import UTC, date, datetime, timedelta

import pytest

from controlplane.billing.rating import micros_to_cents
from controlplane.billing.selectors import usage_daily
from controlplane.billing.services import usage_rollup
from controlplane.catalog.services import price_set
from controlplane.tenancy.project_services import project_create
from controlplane.tenancy.services import api_key_create, project_default_ensure

INGEST_URL = "/api/v1/internal/usage-events"
USAGE_URL = "/api/v1/organization/usage/completions"
COSTS_URL = "/api/v1/organization/costs"
LONG_AGO = datetime(2020, 1, 1, tzinfo=UTC)
DAY = datetime(2026, 11, 18, tzinfo=UTC)  # mid_period_clock's day
HOUR = 3600


def unix(moment: datetime) -> int:
    return int(moment.timestamp())


@pytest.fixture
def ledger(org_a, key_a, internal_client, tiny_model, make_usage_event, mid_period_clock):
    """Usage of a key in project Search and of key_a in the default project, over two days, rolled up."""
    for phase, micros in (("prefill", 1_000_000), ("cached_prefill", 500_000), ("decode", 2_000_000)):
        price_set(model=tiny_model, phase=phase, micros_per_million=micros, effective_from=LONG_AGO)
    search = project_create(organization=org_a, name="Search")
    search_key = api_key_create(organization=org_a, name="search", project=search)
    requests = [  # (key, started at, prompt tokens, cached, output tokens, tier)
        (search_key, DAY.replace(hour=9, minute=10), 120, 64, 30, "standard"),
        (search_key, DAY.replace(hour=9, minute=40), 100, 0, 10, "standard"),
        (key_a, DAY.replace(hour=9, minute=50), 50, 10, 5, "standard"),
        (key_a, DAY.replace(hour=10, minute=5), 70, 0, 7, "batch"),
        (key_a, DAY - timedelta(hours=9), 40, 0, 4, "standard"),
    ]
    events = []
    for number, (key, started, prompt, cached, output, tier) in enumerate(requests):
        at = {"started_at": started.isoformat(), "finished_at": started.isoformat(), "tier": tier}
        events.append(
            make_usage_event(key, f"exec_{number:032x}", "prefill", tokens=prompt, cached_tokens=cached, **at)
        )
        events.append(make_usage_event(key, f"exec_{number:032x}", "decode", tokens=output, cached_tokens=0, **at))
    assert internal_client.post(INGEST_URL, {"events": events}).data["accepted"] == 10
    usage_rollup()
    return {"search": search, "search_key": search_key, "default": project_default_ensure(organization=org_a)}


def test_usage_is_bucketed_by_hour_and_grouped_by_project(client_a, ledger):
    start, end = unix(DAY.replace(hour=9)), unix(DAY.replace(hour=11))
    response = client_a.get(
        USAGE_URL, {"start_time": start, "end_time": end, "bucket_width": "1h", "group_by": "project_id"}
    )
    assert response.status_code == 200, response.data
    page = response.json()
    assert (page["object"], page["has_more"], page["next_page"]) == ("page", False, None)
    assert [(b["object"], b["start_time"], b["end_time"]) for b in page["data"]] == [
        ("bucket", start, start + HOUR),
        ("bucket", start + HOUR, end),
    ]
    nine, ten = (bucket["results"] for bucket in page["data"])
    search, default = ledger["search"].public_id, ledger["default"].public_id
    assert sorted(nine, key=lambda result: result["project_id"] == default) == [
        {
            "object": "organization.usage.completions.result",
            "input_tokens": 220,
            "output_tokens": 40,
            "input_cached_tokens": 64,
            "input_uncached_tokens": 156,
            "input_audio_tokens": 0,
            "output_audio_tokens": 0,
            "num_model_requests": 2,
            "project_id": search,
            "api_key_id": None,
            "model": None,
            "batch": None,
            "user_id": None,
            "service_tier": None,
        },
        {
            "object": "organization.usage.completions.result",
            "input_tokens": 50,
            "output_tokens": 5,
            "input_cached_tokens": 10,
            "input_uncached_tokens": 40,
            "input_audio_tokens": 0,
            "output_audio_tokens": 0,
            "num_model_requests": 1,
            "project_id": default,
            "api_key_id": None,
            "model": None,
            "batch": None,
            "user_id": None,
            "service_tier": None,
        },
    ]
    assert [(r["project_id"], r["input_tokens"], r["num_model_requests"]) for r in ten] == [(default, 70, 1)]


def test_usage_filters_and_brackets(client_a, key_a, ledger):
    base = {"start_time": unix(DAY - timedelta(days=1)), "end_time": unix(DAY + timedelta(days=1))}

    def results(**query):
        page = client_a.get(USAGE_URL, {**base, **query}).json()
        return [result for bucket in page["data"] for result in bucket["results"]]

    [search] = results(project_ids=ledger["search"].public_id)
    assert (search["input_tokens"], search["num_model_requests"]) == (220, 2)
    [batch] = results(batch="true", **{"group_by[]": ["batch", "model"]})
    assert (batch["batch"], batch["model"], batch["input_tokens"]) == (True, "diptych-tiny", 70)
    by_key = results(**{"group_by[]": "api_key_id", "api_key_ids[]": key_a.api_key.public_id})
    assert {result["api_key_id"] for result in by_key} == {key_a.api_key.public_id}
    assert sum(result["num_model_requests"] for result in by_key) == 3
    assert results(models="no-such-model") == []
    assert sum(result["num_model_requests"] for result in results()) == 5


def test_usage_pages_through_every_bucket_once(client_a, ledger):
    query = {"start_time": unix(DAY - timedelta(hours=9)), "end_time": unix(DAY.replace(hour=11)), "bucket_width": "1h"}
    starts, requests, page_sizes = [], 0, []
    page = client_a.get(USAGE_URL, {**query, "limit": 7}).json()
    while True:
        page_sizes.append(len(page["data"]))
        starts += [bucket["start_time"] for bucket in page["data"]]
        requests += sum(r["num_model_requests"] for bucket in page["data"] for r in bucket["results"])
        if not page["has_more"]:
            break
        page = client_a.get(USAGE_URL, {**query, "limit": 7, "page": page["next_page"]}).json()
    assert page_sizes == [7, 7, 6]
    assert starts == list(range(query["start_time"], query["end_time"], HOUR))
    assert requests == 5


@pytest.mark.parametrize(
    ("query", "field"),
    [
        ({}, "start_time"),
        ({"start_time": 100, "bucket_width": "1d", "limit": 32}, "limit"),
        ({"start_time": 100, "bucket_width": "1m", "limit": 1441}, "limit"),
        ({"start_time": 100, "bucket_width": "2h"}, "bucket_width"),
        ({"start_time": 100, "end_time": 100}, "end_time"),
        ({"start_time": 0, "end_time": 86400 * 3, "page": "12"}, "page"),
        ({"start_time": 100, "group_by": "user_id"}, "group_by"),
    ],
)
def test_usage_refuses_a_bad_query_naming_the_field(client_a, query, field):
    response = client_a.get(USAGE_URL, query)
    assert response.status_code == 400
    assert field in str(response.data["error"])


def test_an_inference_key_may_read_neither(org_a, make_bearer_client):
    client = make_bearer_client(api_key_create(organization=org_a, name="inference").key)
    assert client.get(USAGE_URL, {"start_time": 0}).status_code == 403
    assert client.get(COSTS_URL, {"start_time": 0}).status_code == 403


def test_costs_add_up_to_the_cent_to_usage_daily(client_a, org_a, ledger):
    start, end = DAY - timedelta(days=1), DAY + timedelta(days=1)
    page = client_a.get(COSTS_URL, {"start_time": unix(start), "end_time": unix(end)}).json()
    assert [(b["start_time"], b["end_time"]) for b in page["data"]] == [
        (unix(start), unix(DAY)),
        (unix(DAY), unix(end)),
    ]
    total_dollars = sum(r["amount"]["value"] for bucket in page["data"] for r in bucket["results"])
    daily = usage_daily(organization=org_a, start=date(2026, 11, 17), end=date(2026, 11, 18), group_by="model")
    daily_micros = sum(row["amount_micros"] for row in daily)
    assert daily_micros > 0
    assert round(total_dollars * 100) == micros_to_cents(daily_micros)
    assert round(total_dollars * 1_000_000) == daily_micros  # one model: the same rows, the same rounding
    [result] = page["data"][0]["results"]
    # 40 prompt tokens at $1 per million and 4 output tokens at $2 per million.
    assert result == {
        "object": "organization.costs.result",
        "amount": {"value": 0.000048, "currency": "usd"},
        "line_item": None,
        "project_id": None,
        "api_key_id": None,
    }


def test_costs_group_by_project_and_line_item(client_a, ledger):
    query = {"start_time": unix(DAY), "end_time": unix(DAY + timedelta(days=1))}
    [bucket] = client_a.get(COSTS_URL, {**query, "group_by": "project_id"}).json()["data"]
    by_project = {r["project_id"]: round(r["amount"]["value"] * 1_000_000) for r in bucket["results"]}
    # Search: 156 computed at $1, 64 cached at $0.50, 40 output at $2 per million; the default project's
    # requests: 40 + 10 × 0.5 + 5 × 2, and 70 + 7 × 2 for the batch one (no batch price set: the standard one).
    assert by_project == {
        ledger["search"].public_id: 156 + 32 + 80,
        ledger["default"].public_id: 40 + 5 + 10 + 70 + 14,
    }
    [bucket] = client_a.get(
        COSTS_URL, {**query, "group_by[]": "line_item", "project_ids": ledger["search"].public_id}
    ).json()["data"]
    items = {r["line_item"]: round(r["amount"]["value"] * 1_000_000) for r in bucket["results"]}
    assert items == {"diptych-tiny, input": 156, "diptych-tiny, cached input": 32, "diptych-tiny, output": 80}
    only_output = client_a.get(COSTS_URL, {**query, "group_by": "line_item", "line_items": "diptych-tiny, output"})
    assert [r["line_item"] for r in only_output.json()["data"][0]["results"]] == ["diptych-tiny, output"]
    assert client_a.get(COSTS_URL, {**query, "bucket_width": "1h"}).status_code == 400
    assert client_a.get(COSTS_URL, {**query, "limit": 181}).status_code == 400


def test_usage_daily_and_requests_group_by_project_and_filter_by_it(client_a, ledger):
    days = {"start": "2026-11-17", "end": "2026-11-18"}
    search, default = ledger["search"].public_id, ledger["default"].public_id
    daily = client_a.get("/api/v1/usage/daily", {**days, "group_by": "project"}).json()["data"]
    spend = {(row["day"], row["key"]): row["amount_micros"] for row in daily}
    assert spend == {("2026-11-17", default): 48, ("2026-11-18", search): 268, ("2026-11-18", default): 139}
    requests = client_a.get("/api/v1/usage/requests", {**days, "group_by": "project"}).json()["data"]
    assert {(row["day"], row["key"]): row["requests"] for row in requests} == {
        ("2026-11-17", default): 1,
        ("2026-11-18", search): 2,
        ("2026-11-18", default): 2,
    }
    only_search = client_a.get("/api/v1/usage/daily", {**days, "group_by": "model", "project_id": search}).json()
    assert [(row["key"], row["amount_micros"]) for row in only_search["data"]] == [("diptych-tiny", 268)]
    searched = client_a.get("/api/v1/usage/requests", {**days, "group_by": "model", "project_id": search}).json()
    assert [row["requests"] for row in searched["data"]] == [2]
