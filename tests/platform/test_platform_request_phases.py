"""A request's phases as its tenant sees them (GET usage/requests/{id}), the request log (usage/request-log) and
the latency percentiles per day and model (usage/latency), from events ingested as the gateway posts them."""

from datetime import timedelta

import pytest
from django.db import connection
from django.test.utils import CaptureQueriesContext

from controlplane.catalog.services import price_set
from controlplane.metering.latency_sql import percentile_cont
from controlplane.tenancy.services import api_key_create
from tests.platform.conftest import USAGE_STARTED_AT, bearer_client, usage_event
from tests.platform.test_platform_billing import LONG_AGO, TINY_PRICES

INGEST_URL = "/api/v1/internal/usage-events"
SPLIT_ID = "exec_" + "a" * 32
COLOCATED_ID = "exec_" + "b" * 32
T0 = USAGE_STARTED_AT
DAY = T0.date().isoformat()


def at(ms: float) -> str:
    return (T0 + timedelta(milliseconds=ms)).isoformat()


def split_events(key, request_id: str = SPLIT_ID, offset_ms: float = 0, **labels) -> list[dict]:
    """A split request: 40 ms of prefill (35 of them computing), 2 ms until decode starts, 100 ms of decode."""
    return [
        usage_event(
            key,
            request_id,
            "prefill",
            worker_id="wrk_prefill0",
            tokens=120,
            cached_tokens=64,
            kv_bytes=3 * 2**20,
            compute_ms=35,
            started_at=at(offset_ms),
            finished_at=at(offset_ms + 40),
            **labels,
        ),
        usage_event(
            key,
            request_id,
            "decode",
            worker_id="wrk_decode0",
            tokens=20,
            cached_tokens=0,
            kv_bytes=3 * 2**20,
            compute_ms=50,
            started_at=at(offset_ms + 42),
            finished_at=at(offset_ms + 142),
            **labels,
        ),
    ]


def colocated_events(key, request_id: str = COLOCATED_ID, offset_ms: float = 500, **labels) -> list[dict]:
    """A colocated request as its worker reports it: 8 ms of compute by the first token, 20 ms by the last."""
    common = {"worker_id": "wrk_colocated0", "kv_bytes": 0, **labels}
    return [
        usage_event(key, request_id, "prefill", tokens=30, cached_tokens=0, compute_ms=8,
                    started_at=at(offset_ms), finished_at=at(offset_ms + 10), **common),
        usage_event(key, request_id, "decode", tokens=5, cached_tokens=0, compute_ms=20,
                    started_at=at(offset_ms + 10), finished_at=at(offset_ms + 25), **common),
    ]  # fmt: skip


def ingest(internal_client, events: list[dict]) -> None:
    answer = internal_client.post(INGEST_URL, {"events": events}, format="json")
    assert answer.status_code == 200, answer.json()
    assert answer.json()["accepted"] == len(events)


@pytest.fixture
def tiny_prices(tiny_model):
    for phase, micros in TINY_PRICES.items():
        price_set(model=tiny_model, phase=phase, micros_per_million=micros, effective_from=LONG_AGO)


# ---- one request -------------------------------------------------------------------------------------------


def test_a_split_requests_phases_in_time_order_with_totals_and_one_rounded_cost(
    client_a, internal_client, key_a, tiny_prices
):
    ingest(internal_client, split_events(key_a))
    answer = client_a.get(f"/api/v1/usage/requests/{SPLIT_ID}")
    assert answer.status_code == 200, answer.json()
    body = answer.json()
    assert (body["id"], body["object"], body["route"], body["model"]) == (
        SPLIT_ID,
        "usage.request",
        "split",
        "diptych-tiny",
    )
    assert body["api_key_id"] == key_a.api_key.public_id
    assert body["project_id"] == key_a.api_key.project.public_id
    assert (body["duration_ms"], body["time_to_first_token_ms"]) == (142.0, 40.0)
    prefill, handoff, decode = body["phases"]
    assert prefill == {
        "type": "prefill", "worker_id": "wrk_prefill0", "started_at": prefill["started_at"],
        "finished_at": prefill["finished_at"], "offset_ms": 0.0, "duration_ms": 40.0, "compute_ms": 35,
        "queued_ms": 5.0, "computed_tokens": 56, "cached_tokens": 64, "output_tokens": None, "kv_bytes": None,
    }  # fmt: skip
    assert (handoff["type"], handoff["worker_id"], handoff["kv_bytes"]) == ("kv_handoff", None, 3 * 2**20)
    assert (handoff["offset_ms"], handoff["duration_ms"]) == (40.0, 2.0)
    assert (decode["type"], decode["worker_id"], decode["output_tokens"]) == ("decode", "wrk_decode0", 20)
    assert (decode["offset_ms"], decode["duration_ms"], decode["compute_ms"]) == (42.0, 100.0, 50)
    assert body["totals"] == {
        "prompt_tokens": 120, "computed_tokens": 56, "cached_tokens": 64, "output_tokens": 20,
        "kv_bytes": 3 * 2**20, "compute_ms": 85,
    }  # fmt: skip
    # 56 × 0.1 + 64 × 0.025 + 20 × 0.4 = 5.6 + 1.6 + 8 = 15.2 µ$: 15 rounded once (16 if each line were rounded).
    assert body["cost"]["amount_micros"] == 15
    assert body["cost"]["lines"] == [
        {"phase": "prefill", "tokens": 56, "unit_price_micros_per_million": TINY_PRICES["prefill"]},
        {"phase": "cached_prefill", "tokens": 64, "unit_price_micros_per_million": TINY_PRICES["cached_prefill"]},
        {"phase": "decode", "tokens": 20, "unit_price_micros_per_million": TINY_PRICES["decode"]},
    ]


def test_a_colocated_request_is_one_phase(client_a, internal_client, key_a, tiny_prices):
    ingest(internal_client, colocated_events(key_a))
    body = client_a.get(f"/api/v1/usage/requests/{COLOCATED_ID}").json()
    assert body["route"] == "colocated"
    (phase,) = body["phases"]
    assert (phase["type"], phase["worker_id"], phase["duration_ms"], phase["compute_ms"]) == (
        "colocated", "wrk_colocated0", 25.0, 20
    )  # fmt: skip
    assert (phase["queued_ms"], phase["computed_tokens"], phase["output_tokens"]) == (2.0, 30, 5)
    assert (body["time_to_first_token_ms"], body["totals"]["compute_ms"]) == (10.0, 20)


def test_a_choice_of_an_n_request_is_its_decode_alone_and_an_unpriced_model_costs_nothing(
    client_a, internal_client, key_a
):
    choice = f"{SPLIT_ID}-c1"
    ingest(internal_client, [split_events(key_a, request_id=choice)[1]])
    body = client_a.get(f"/api/v1/usage/requests/{choice}").json()
    assert (body["route"], [p["type"] for p in body["phases"]], body["time_to_first_token_ms"]) == (
        "decode_only", ["decode"], None
    )  # fmt: skip
    assert body["cost"] == {
        "currency": "usd", "amount_micros": 0,
        "lines": [{"phase": "decode", "tokens": 20, "unit_price_micros_per_million": None}],
    }  # fmt: skip


def test_another_organizations_request_is_not_found_and_nothing_of_it_is_told(
    client_a, client_b, internal_client, key_a, key_b
):
    ingest(internal_client, split_events(key_a, client_request_id="user-42"))
    for path in (SPLIT_ID, "user-42"):
        answer = client_b.get(f"/api/v1/usage/requests/{path}")
        assert answer.status_code == 404
        assert answer.json()["error"]["type"] == "not_found"
        assert "wrk_" not in answer.content.decode()
    listed = client_b.get("/api/v1/usage/request-log", {"start": DAY, "end": DAY}).json()
    assert listed["data"] == []
    assert client_b.get("/api/v1/usage/latency", {"start": DAY, "end": DAY}).json()["data"] == []
    assert client_b.get("/api/v1/usage/request-log", {"start": DAY, "end": DAY, "after": SPLIT_ID}).status_code == 404


def test_bad_and_unknown_ids(client_a, internal_client, key_a):
    ingest(internal_client, split_events(key_a))
    unknown = client_a.get("/api/v1/usage/requests/exec_" + "0" * 32)
    assert (unknown.status_code, unknown.json()["error"]["type"]) == (404, "not_found")
    too_long = client_a.get("/api/v1/usage/requests/" + "x" * 129)
    assert too_long.status_code == 400
    assert too_long.json()["error"]["fields"] == {"request_id": ["At most 128 characters."]}


def test_a_clients_label_finds_the_request_only_when_it_labels_one(client_a, internal_client, key_a):
    ingest(internal_client, split_events(key_a, client_request_id="only-once"))
    ingest(internal_client, split_events(key_a, request_id="exec_" + "1" * 32, client_request_id="twice"))
    ingest(internal_client, colocated_events(key_a, request_id="exec_" + "2" * 32, client_request_id="twice"))
    found = client_a.get("/api/v1/usage/requests/only-once")
    assert (found.status_code, found.json()["id"]) == (200, SPLIT_ID)
    ambiguous = client_a.get("/api/v1/usage/requests/twice")
    assert ambiguous.status_code == 400
    assert ambiguous.json()["error"]["type"] == "ambiguous_request_id"
    assert "exec_" not in ambiguous.json()["error"]["message"]


def test_reading_requests_needs_the_usage_read_permission(org_a, internal_client, key_a):
    ingest(internal_client, split_events(key_a))
    inference_only = bearer_client(api_key_create(organization=org_a, name="app", scopes=["inference"]).key)
    assert inference_only.get(f"/api/v1/usage/requests/{SPLIT_ID}").status_code == 403
    for path in ("usage/request-log", "usage/latency"):
        assert inference_only.get(f"/api/v1/{path}", {"start": DAY, "end": DAY}).status_code == 403, path


# ---- the request log ------------------------------------------------------------------------------------------


def test_the_request_log_pages_newest_first_with_each_requests_phases(client_a, internal_client, key_a):
    ids = [f"exec_{index:032x}" for index in range(5)]
    for index, request_id in enumerate(ids):
        ingest(internal_client, split_events(key_a, request_id=request_id, offset_ms=index * 1000))
    query = {"start": DAY, "end": DAY, "limit": 2}
    first = client_a.get("/api/v1/usage/request-log", query).json()
    assert [row["id"] for row in first["data"]] == [ids[4], ids[3]]
    assert (first["object"], first["first_id"], first["last_id"], first["has_more"]) == ("list", ids[4], ids[3], True)
    assert [phase["type"] for phase in first["data"][0]["phases"]] == ["prefill", "kv_handoff", "decode"]
    second = client_a.get("/api/v1/usage/request-log", {**query, "after": first["last_id"]}).json()
    third = client_a.get("/api/v1/usage/request-log", {**query, "after": second["last_id"]}).json()
    assert [row["id"] for row in second["data"] + third["data"]] == [ids[2], ids[1], ids[0]]
    assert (second["has_more"], third["has_more"]) == (True, False)


def test_requests_that_start_together_page_by_id_without_a_gap(client_a, internal_client, key_a):
    ids = sorted(f"exec_{index:032x}" for index in range(3))
    for request_id in ids:
        ingest(internal_client, split_events(key_a, request_id=request_id))
    seen, after = [], None
    while True:
        query = {"start": DAY, "end": DAY, "limit": 1, **({"after": after} if after else {})}
        page = client_a.get("/api/v1/usage/request-log", query).json()
        seen += [row["id"] for row in page["data"]]
        after = page["last_id"]
        if not page["has_more"]:
            break
    assert seen == ids[::-1]


def test_the_request_log_filters_by_key_project_model_and_day(org_a, client_a, internal_client, key_a, tiny_model):
    other_key = api_key_create(organization=org_a, name="other", scopes=["inference"])
    ingest(internal_client, split_events(key_a))
    ingest(internal_client, colocated_events(other_key, model="other-model"))
    log = "/api/v1/usage/request-log"
    day = {"start": DAY, "end": DAY}

    def ids(**query) -> list[str]:
        answer = client_a.get(log, {**day, **query})
        assert answer.status_code == 200, answer.json()
        return [row["id"] for row in answer.json()["data"]]

    assert ids() == [COLOCATED_ID, SPLIT_ID]
    assert ids(api_key_id=key_a.api_key.public_id) == [SPLIT_ID]
    assert ids(model="other-model") == [COLOCATED_ID]
    assert ids(project_id=key_a.api_key.project.public_id) == [COLOCATED_ID, SPLIT_ID]
    assert ids(project_id="proj_nope") == []
    yesterday = (T0 - timedelta(days=1)).date().isoformat()
    assert client_a.get(log, {"start": yesterday, "end": yesterday}).json()["data"] == []


@pytest.mark.parametrize(
    ("query", "field"),
    [
        ({}, "start"),
        ({"start": DAY, "end": "2000-01-01"}, "end"),
        ({"start": DAY, "end": DAY, "limit": 0}, "limit"),
        ({"start": DAY, "end": DAY, "limit": 101}, "limit"),
        ({"start": DAY, "end": DAY, "model": ""}, "model"),
        ({"start": "yesterday", "end": DAY}, "start"),
    ],
)
def test_bad_request_log_and_latency_queries_are_refused_by_field(client_a, query, field):
    for path in ("usage/request-log", "usage/latency"):
        if field == "limit" and path == "usage/latency":
            continue
        answer = client_a.get(f"/api/v1/{path}", query)
        assert answer.status_code == 400, (path, query)
        assert field in answer.json()["error"]["fields"], answer.json()


def test_an_unknown_cursor_is_not_found(client_a):
    answer = client_a.get("/api/v1/usage/request-log", {"start": DAY, "end": DAY, "after": "exec_nope"})
    assert (answer.status_code, answer.json()["error"]["fields"]) == (404, {"after": ["Unknown id."]})


# ---- latency percentiles ------------------------------------------------------------------------------------


def latency_events(key, request_id: str, offset_ms: float, first_token_ms: float, total_ms: float, **labels):
    prefill, decode = split_events(key, request_id=request_id, offset_ms=offset_ms, **labels)
    prefill["finished_at"] = at(offset_ms + first_token_ms)
    decode["started_at"] = at(offset_ms + first_token_ms)
    decode["finished_at"] = at(offset_ms + total_ms)
    return [prefill, decode]


def test_latency_percentiles_per_day_and_model_are_computed_by_the_database(client_a, internal_client, key_a):
    samples = [(10, 100), (20, 300), (40, 200)]  # (time to first token, duration) in ms
    for index, (first_token, total) in enumerate(samples):
        ingest(internal_client, latency_events(key_a, f"exec_{index:032x}", index * 1000, first_token, total))
    ingest(internal_client, latency_events(key_a, "exec_" + "e" * 32, 0, 7, 9, model="other-model"))
    one_token = split_events(key_a, request_id="exec_" + "f" * 32)[0]  # ended by its first token: no decode event
    ingest(internal_client, [{**one_token, "model": "third-model"}])
    with CaptureQueriesContext(connection) as queries:
        answer = client_a.get("/api/v1/usage/latency", {"start": DAY, "end": DAY})
    assert answer.status_code == 200, answer.json()
    rows = answer.json()["data"]
    assert [(row["day"], row["model"], row["requests"]) for row in rows] == [
        (DAY, "diptych-tiny", 3), (DAY, "other-model", 1), (DAY, "third-model", 1)
    ]  # fmt: skip
    assert rows[0]["time_to_first_token_ms"] == {"p50": 20.0, "p90": 36.0, "p99": 39.6}
    assert rows[0]["duration_ms"] == {"p50": 200.0, "p90": 280.0, "p99": 298.0}
    assert rows[1]["time_to_first_token_ms"] == {"p50": 7.0, "p90": 7.0, "p99": 7.0}
    assert rows[2]["duration_ms"] == {"p50": 40.0, "p90": 40.0, "p99": 40.0}
    if connection.vendor == "postgresql":
        assert any("percentile_cont(0.99) WITHIN GROUP" in query["sql"] for query in queries.captured_queries)
    filtered = client_a.get("/api/v1/usage/latency", {"start": DAY, "end": DAY, "model": "other-model"}).json()
    assert [row["model"] for row in filtered["data"]] == ["other-model"]


def test_percentile_cont_interpolates_between_the_closest_ranks():
    assert percentile_cont([], 0.5) is None
    assert percentile_cont([40, 10, 20], 0.9) == pytest.approx(36.0)
    assert percentile_cont([5], 0.99) == 5
