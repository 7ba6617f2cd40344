import logging
from datetime import timedelta

import pytest

from controlplane.metering.models import UsageEvent
from controlplane.tenancy.services import api_key_create, api_key_revoke

INGEST_URL = "/api/v1/internal/usage-events"


def test_ingest_stores_every_field(internal_client, key_a, org_a, make_usage_event, usage_started_at):
    response = internal_client.post(INGEST_URL, {"events": [make_usage_event(key_a)]})
    assert response.status_code == 200
    assert response.data == {"accepted": 1, "duplicates": 0}
    event = UsageEvent.objects.get()
    assert (event.request_id, event.phase, event.organization, event.api_key) == (
        "req-1",
        "prefill",
        org_a,
        key_a.api_key,
    )
    assert (event.tokens, event.cached_tokens, event.kv_bytes, event.compute_ms) == (120, 64, 3 * 2**30, 35)
    assert event.started_at == usage_started_at
    assert event.finished_at == usage_started_at + timedelta(milliseconds=40)
    assert event.ingested_at is not None


def test_ingesting_the_same_batch_twice_stores_it_once(internal_client, key_a, make_usage_event):
    batch = {
        "events": [
            make_usage_event(key_a, "req-1", "prefill"),
            make_usage_event(key_a, "req-1", "decode", cached_tokens=0),
            make_usage_event(key_a, "req-2", "prefill"),
        ]
    }
    first = internal_client.post(INGEST_URL, batch)
    stored = list(UsageEvent.objects.order_by("id").values())
    second = internal_client.post(INGEST_URL, batch)
    assert first.data == {"accepted": 3, "duplicates": 0}
    assert second.status_code == 200
    assert second.data == {"accepted": 0, "duplicates": 3}
    assert list(UsageEvent.objects.order_by("id").values()) == stored


def test_a_partly_new_batch_stores_only_the_new_events(internal_client, key_a, make_usage_event):
    internal_client.post(INGEST_URL, {"events": [make_usage_event(key_a, "req-1")]})
    batch = {"events": [make_usage_event(key_a, "req-1"), make_usage_event(key_a, "req-2")]}
    response = internal_client.post(INGEST_URL, batch)
    assert response.data == {"accepted": 1, "duplicates": 1}
    assert sorted(UsageEvent.objects.values_list("request_id", flat=True)) == ["req-1", "req-2"]


def test_first_write_wins_and_a_conflicting_duplicate_is_logged(internal_client, key_a, caplog, make_usage_event):
    internal_client.post(INGEST_URL, {"events": [make_usage_event(key_a, tokens=120)]})
    with caplog.at_level(logging.WARNING, logger="controlplane.metering"):
        response = internal_client.post(INGEST_URL, {"events": [make_usage_event(key_a, tokens=999)]})
    assert response.data == {"accepted": 0, "duplicates": 1}
    assert UsageEvent.objects.get().tokens == 120
    assert any("req-1" in record.getMessage() and record.levelno == logging.WARNING for record in caplog.records)


def test_identical_duplicates_are_not_logged(internal_client, key_a, caplog, make_usage_event):
    internal_client.post(INGEST_URL, {"events": [make_usage_event(key_a)]})
    with caplog.at_level(logging.WARNING, logger="controlplane.metering"):
        internal_client.post(INGEST_URL, {"events": [make_usage_event(key_a)]})
    assert not [record for record in caplog.records if record.levelno >= logging.WARNING]


def test_duplicates_within_one_batch_count_once(internal_client, key_a, caplog, make_usage_event):
    with caplog.at_level(logging.WARNING, logger="controlplane.metering"):
        response = internal_client.post(
            INGEST_URL, {"events": [make_usage_event(key_a, tokens=80), make_usage_event(key_a, tokens=90)]}
        )
    assert response.data == {"accepted": 1, "duplicates": 1}
    assert UsageEvent.objects.get().tokens == 80
    assert caplog.records


def test_usage_of_a_since_revoked_key_is_still_recorded(internal_client, key_a, make_usage_event):
    api_key_revoke(api_key=key_a.api_key)
    response = internal_client.post(INGEST_URL, {"events": [make_usage_event(key_a)]})
    assert response.data == {"accepted": 1, "duplicates": 0}


def test_an_empty_batch_is_accepted(internal_client, db):
    assert internal_client.post(INGEST_URL, {"events": []}).data == {"accepted": 0, "duplicates": 0}


INVALID_EVENTS = [
    ({"phase": "both"}, "phase"),
    ({"tokens": -1}, "tokens"),
    ({"cached_tokens": -1}, "cached_tokens"),
    ({"kv_bytes": -5}, "kv_bytes"),
    ({"compute_ms": -5}, "compute_ms"),
    ({"kv_bytes": 2**63}, "kv_bytes"),
    ({"tokens": "ten"}, "tokens"),
    ({"cached_tokens": 121}, "cached_tokens"),
    ({"started_at": "yesterday"}, "started_at"),
    ({"started_at": "2030-01-01T00:00:01Z", "finished_at": "2030-01-01T00:00:00Z"}, "finished_at"),
    ({"request_id": ""}, "request_id"),
    ({"request_id": "r" * 129}, "request_id"),
    ({"organization_id": "org_unknown"}, "organization_id"),
    ({"api_key_id": "key_unknown"}, "api_key_id"),
]


@pytest.mark.parametrize(("overrides", "field"), INVALID_EVENTS)
def test_one_invalid_event_rejects_the_whole_batch(internal_client, key_a, overrides, field, make_usage_event):
    bad_event = make_usage_event(key_a, **{"request_id": "bad", **overrides})
    batch = {"events": [make_usage_event(key_a, "good-1"), bad_event, make_usage_event(key_a, "good-2")]}
    response = internal_client.post(INGEST_URL, batch)
    assert response.status_code == 400
    error = response.data["error"]
    assert error["type"] == "validation_error"
    assert f"events[1].{field}" in error["fields"]
    assert f"events[1].{field}" in error["message"]
    assert UsageEvent.objects.count() == 0


def test_a_missing_field_is_reported_by_index(internal_client, key_a, make_usage_event):
    event = make_usage_event(key_a)
    del event["worker_id"]
    response = internal_client.post(INGEST_URL, {"events": [make_usage_event(key_a, "ok"), event]})
    assert response.status_code == 400
    assert "events[1].worker_id" in response.data["error"]["fields"]


def test_an_api_key_of_another_organization_is_rejected(internal_client, key_a, key_b, org_b, make_usage_event):
    event = make_usage_event(key_a, organization_id=org_b.public_id)
    response = internal_client.post(INGEST_URL, {"events": [event]})
    assert response.status_code == 400
    assert "does not belong" in response.data["error"]["fields"]["events[0].api_key_id"][0]
    assert UsageEvent.objects.count() == 0


def test_batches_over_1000_events_are_rejected(internal_client, key_a, make_usage_event):
    events = [make_usage_event(key_a, f"req-{index}") for index in range(1001)]
    response = internal_client.post(INGEST_URL, {"events": events})
    assert response.status_code == 400
    assert "events" in response.data["error"]["fields"]
    assert UsageEvent.objects.count() == 0


def test_a_batch_of_1000_events_is_accepted(internal_client, key_a, make_usage_event):
    events = [make_usage_event(key_a, f"req-{index}") for index in range(1000)]
    assert internal_client.post(INGEST_URL, {"events": events}).data == {"accepted": 1000, "duplicates": 0}
    assert UsageEvent.objects.count() == 1000


@pytest.mark.parametrize("body", [{}, {"events": "nope"}, {"events": [1, 2]}, ["not-an-object"]])
def test_malformed_bodies_are_rejected(internal_client, db, body):
    response = internal_client.post(INGEST_URL, body, format="json")
    assert response.status_code == 400
    assert response.data["error"]["message"]


def test_usage_events_list_filters_and_paginates(internal_client, client_a, key_a, org_a, make_usage_event):
    other_key = api_key_create(organization=org_a, name="second")
    internal_client.post(
        INGEST_URL,
        {
            "events": [
                make_usage_event(key_a, "req-1", "prefill"),
                make_usage_event(key_a, "req-1", "decode", cached_tokens=0),
                make_usage_event(other_key, "req-2", "prefill", model="other-model"),
            ]
        },
    )
    everything = client_a.get("/api/v1/usage-events")
    assert everything.status_code == 200
    assert everything.data["total"] == 3
    assert {(row["request_id"], row["phase"]) for row in everything.data["data"]} == {
        ("req-1", "prefill"),
        ("req-1", "decode"),
        ("req-2", "prefill"),
    }
    by_request = client_a.get("/api/v1/usage-events", {"request_id": "req-1"}).data
    assert {row["phase"] for row in by_request["data"]} == {"prefill", "decode"}
    by_phase = client_a.get("/api/v1/usage-events", {"phase": "decode"}).data
    assert [(row["request_id"], row["api_key_id"]) for row in by_phase["data"]] == [("req-1", key_a.api_key.public_id)]
    by_model = client_a.get("/api/v1/usage-events", {"model": "other-model"}).data
    assert [row["request_id"] for row in by_model["data"]] == ["req-2"]
    page = client_a.get("/api/v1/usage-events", {"limit": 1, "offset": 1}).data
    assert page["total"] == 3 and len(page["data"]) == 1


def test_usage_events_list_rejects_an_unknown_phase(client_a):
    response = client_a.get("/api/v1/usage-events", {"phase": "both"})
    assert response.status_code == 400
    assert "phase" in response.data["error"]["fields"]


def test_usage_summary_groups_by_model_and_phase(internal_client, client_a, key_a, make_usage_event):
    internal_client.post(
        INGEST_URL,
        {
            "events": [
                make_usage_event(key_a, "req-1", "prefill", tokens=100, cached_tokens=40),
                make_usage_event(key_a, "req-2", "prefill", tokens=50, cached_tokens=0),
                make_usage_event(key_a, "req-1", "decode", tokens=30, cached_tokens=0),
                make_usage_event(key_a, "req-3", "prefill", model="other-model", tokens=7, cached_tokens=7),
            ]
        },
    )
    response = client_a.get("/api/v1/usage/summary")
    assert response.status_code == 200
    assert response.data["object"] == "list"
    assert response.data["data"] == [
        {
            "model": "diptych-tiny",
            "phase": "decode",
            "tier": "standard",
            "requests": 1,
            "tokens": 30,
            "cached_tokens": 0,
        },
        {
            "model": "diptych-tiny",
            "phase": "prefill",
            "tier": "standard",
            "requests": 2,
            "tokens": 110,
            "cached_tokens": 40,
        },
        {
            "model": "other-model",
            "phase": "prefill",
            "tier": "standard",
            "requests": 1,
            "tokens": 0,
            "cached_tokens": 7,
        },
    ]
