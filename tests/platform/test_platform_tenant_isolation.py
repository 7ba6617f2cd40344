"""Organization B's key must never see or change organization A's objects, through any endpoint."""

import pytest

from controlplane.metering.models import UsageEvent
from controlplane.tenancy.models import ApiKey, Organization
from controlplane.tenancy.scoping import organization_rows
from controlplane.tenancy.selectors import api_key_list
from controlplane.tenancy.services import api_key_create

INGEST_URL = "/api/v1/internal/usage-events"


def test_organization_endpoint_answers_the_callers_organization(client_a, client_b, org_a, org_b):
    assert client_a.get("/api/v1/organization").data["id"] == org_a.public_id
    response = client_b.get("/api/v1/organization")
    assert response.data == {
        "id": org_b.public_id,
        "name": "Bravo",
        "slug": "bravo",
        "created_at": response.data["created_at"],
    }


def test_api_keys_of_another_organization_are_invisible(client_a, client_b, key_a, key_b):
    extra_a = api_key_create(organization=key_a.api_key.organization, name="a-extra")
    ids_seen_by_b = {item["id"] for item in client_b.get("/api/v1/api-keys").data["data"]}
    assert ids_seen_by_b == {key_b.api_key.public_id}

    for key in (key_a, extra_a):
        response = client_b.get(f"/api/v1/api-keys/{key.api_key.public_id}")
        assert response.status_code == 404
        assert response.data["error"]["type"] == "not_found"

    ids_seen_by_a = {item["id"] for item in client_a.get("/api/v1/api-keys").data["data"]}
    assert ids_seen_by_a == {key_a.api_key.public_id, extra_a.api_key.public_id}


def test_api_keys_of_another_organization_cannot_be_revoked(client_a, client_b, key_a):
    response = client_b.post(f"/api/v1/api-keys/{key_a.api_key.public_id}/revoke")
    assert response.status_code == 404
    assert ApiKey.objects.get(pk=key_a.api_key.pk).revoked_at is None
    assert client_a.get("/api/v1/organization").status_code == 200


def test_created_keys_belong_to_the_callers_organization(client_b, org_b):
    response = client_b.post("/api/v1/api-keys", {"name": "b-created"})
    assert ApiKey.objects.get(public_id=response.data["id"]).organization == org_b


def test_usage_of_another_organization_is_invisible(
    internal_client, client_a, client_b, key_a, key_b, make_usage_event
):
    internal_client.post(
        INGEST_URL,
        {
            "events": [
                make_usage_event(key_a, "req-a"),
                make_usage_event(key_a, "req-shared"),
                make_usage_event(key_b, "req-b"),
            ]
        },
    )
    assert UsageEvent.objects.count() == 3

    b_events = client_b.get("/api/v1/usage-events").data
    assert [row["request_id"] for row in b_events["data"]] == ["req-b"]
    assert client_b.get("/api/v1/usage-events", {"request_id": "req-a"}).data["total"] == 0
    assert client_b.get("/api/v1/usage-events", {"model": "diptych-tiny", "phase": "prefill"}).data["total"] == 1

    b_summary = client_b.get("/api/v1/usage/summary").data["data"]
    assert b_summary == [
        {
            "model": "diptych-tiny",
            "phase": "prefill",
            "tier": "standard",
            "requests": 1,
            "tokens": 56,
            "cached_tokens": 64,
        }
    ]
    assert client_a.get("/api/v1/usage/summary").data["data"][0]["requests"] == 2


def test_platform_catalog_is_shared_and_read_only(client_a, client_b, tiny_model, prefill_fleet):
    for client in (client_a, client_b):
        assert [model["name"] for model in client.get("/api/v1/models").data["data"]] == ["diptych-tiny"]
        assert client.get("/api/v1/models/diptych-tiny").data["fleets"] == ["tiny-prefill"]
        for url in ("/api/v1/models", "/api/v1/models/diptych-tiny"):
            assert client.post(url, {"name": "mine"}).status_code == 405
            assert client.delete(url).status_code == 405


def test_unknown_model_is_404(client_a, db):
    response = client_a.get("/api/v1/models/no-such-model")
    assert response.status_code == 404
    assert "no-such-model" in response.data["error"]["message"]


def test_fleets_and_workers_are_for_staff_only_and_never_expose_fleet_tokens(
    client_a, prefill_fleet, prefill_client, staff_client
):
    prefill_client.post("/api/v1/internal/workers/register", {"address": "10.0.0.7:50061", "name": "prefill-0"})
    for url in ("/api/v1/fleets", "/api/v1/workers"):
        refused = client_a.get(url)
        assert refused.status_code == 403
        assert "staff" in refused.data["error"]["message"].lower()
    fleets = staff_client.get("/api/v1/fleets")
    workers = staff_client.get("/api/v1/workers")
    assert [worker["name"] for worker in workers.data["data"]] == ["prefill-0"]
    assert workers.data["data"][0]["address"] == "10.0.0.7:50061"
    body = fleets.content.decode() + workers.content.decode()
    prefill_fleet.fleet.refresh_from_db()
    assert prefill_fleet.fleet.token_hash not in body
    assert prefill_fleet.token not in body
    assert set(fleets.data["data"][0]) == {"name", "role", "model", "region", "hardware_class", "created_at"}


@pytest.mark.parametrize("organization", [None, "org_x", Organization(name="unsaved", slug="unsaved")])
def test_organization_rows_cannot_be_built_without_a_saved_organization(db, organization):
    with pytest.raises(TypeError, match="saved Organization"):
        organization_rows(ApiKey, organization=organization)


def test_selectors_refuse_a_missing_organization(db):
    with pytest.raises(TypeError):
        api_key_list(organization=None)
