import hashlib
from datetime import timedelta

import pytest
from django.utils import timezone
from rest_framework.test import APIClient

from controlplane.common.tokens import BASE62_ALPHABET
from controlplane.tenancy.api_keys import generate_api_key, looks_like_api_key
from controlplane.tenancy.models import ApiKey
from controlplane.tenancy.services import LAST_USED_AT_RESOLUTION, api_key_create, api_key_revoke


def _with_char_changed(key: str, position: int) -> str:
    replacement = "A" if key[position] != "A" else "B"
    return key[:position] + replacement + key[position + 1 :]


def test_generated_key_has_prefix_random_part_and_checksum():
    key = generate_api_key()
    assert key.startswith("dip_")
    assert len(key) == 4 + 32 + 6
    assert all(char in BASE62_ALPHABET for char in key[4:])
    assert looks_like_api_key(key)


def test_generated_keys_are_unique():
    assert len({generate_api_key() for _ in range(200)}) == 200


@pytest.mark.parametrize("position", [4, 20, 35, 36, 41])
def test_checksum_catches_a_single_changed_character(position):
    key = generate_api_key()
    assert not looks_like_api_key(_with_char_changed(key, position))


@pytest.mark.parametrize(
    "candidate",
    ["", "dip_", "dft_" + "a" * 38, "dip_" + "a" * 37, "dip_" + "a" * 39, "dip_" + "!" * 38, None, 42],
)
def test_looks_like_api_key_rejects_other_shapes(candidate):
    assert not looks_like_api_key(candidate)


def test_only_the_sha256_of_the_key_is_stored(org_a):
    issued = api_key_create(organization=org_a, name="ci")
    row = ApiKey.objects.values().get(pk=issued.api_key.pk)
    assert row["key_hash"] == hashlib.sha256(issued.key.encode()).hexdigest()
    assert row["prefix"] == issued.key[:12]
    assert not any(isinstance(value, str) and issued.key in value for value in row.values())


def test_create_returns_the_key_once(client_a, org_a, make_bearer_client):
    response = client_a.post("/api/v1/api-keys", {"name": "deploy", "scopes": ["inference", "admin:read"]})
    assert response.status_code == 201
    assert response.data["scopes"] == ["inference", "admin:read"]
    key = response.data["key"]
    assert looks_like_api_key(key)
    assert response.data["prefix"] == key[:12]
    created = ApiKey.objects.get(public_id=response.data["id"])
    assert created.organization == org_a

    detail = client_a.get(f"/api/v1/api-keys/{response.data['id']}")
    listing = client_a.get("/api/v1/api-keys")
    assert "key" not in detail.data
    assert all("key" not in item for item in listing.data["data"])
    assert key not in detail.content.decode() + listing.content.decode()
    assert make_bearer_client(key).get("/api/v1/organization").status_code == 200


def test_create_with_expiry(client_a):
    expires_at = timezone.now() + timedelta(days=30)
    response = client_a.post("/api/v1/api-keys", {"name": "temp", "expires_at": expires_at.isoformat()})
    assert response.status_code == 201
    assert ApiKey.objects.get(public_id=response.data["id"]).expires_at == expires_at


@pytest.mark.parametrize(
    ("body", "field"),
    [
        ({}, "name"),
        ({"name": ""}, "name"),
        ({"name": "x" * 101}, "name"),
        ({"name": "old", "expires_at": "2001-01-01T00:00:00Z"}, "expires_at"),
        ({"name": "bad-date", "expires_at": "tomorrow"}, "expires_at"),
    ],
)
def test_create_rejects_bad_input_and_creates_nothing(client_a, body, field):
    keys_before = ApiKey.objects.count()
    response = client_a.post("/api/v1/api-keys", body)
    assert response.status_code == 400
    assert response.data["error"]["type"] == "validation_error"
    assert field in response.data["error"]["fields"]
    assert ApiKey.objects.count() == keys_before


def test_list_is_paginated(client_a, org_a):
    for index in range(3):
        api_key_create(organization=org_a, name=f"key-{index}")
    response = client_a.get("/api/v1/api-keys", {"limit": 2})
    assert response.status_code == 200
    assert response.data["total"] == 4
    assert len(response.data["data"]) == 2
    assert response.data["has_more"] is True


def test_revoke_is_idempotent(client_a, org_a):
    other = api_key_create(organization=org_a, name="to-revoke")
    url = f"/api/v1/api-keys/{other.api_key.public_id}/revoke"
    first = client_a.post(url)
    second = client_a.post(url)
    assert first.status_code == second.status_code == 200
    assert first.data["revoked_at"] is not None
    assert second.data["revoked_at"] == first.data["revoked_at"]
    assert ApiKey.objects.get(pk=other.api_key.pk).revoked_at is not None


PUBLIC_GET_ENDPOINTS = [
    "/api/v1/organization",
    "/api/v1/api-keys",
    "/api/v1/models",
    "/api/v1/models/diptych-tiny",
    "/api/v1/prices",
    "/api/v1/usage-events",
    "/api/v1/usage/summary",
]


@pytest.mark.parametrize("url", PUBLIC_GET_ENDPOINTS)
def test_revoked_key_is_refused_at_once_by_every_endpoint(client_a, key_a, tiny_model, url):
    assert client_a.get(url).status_code == 200
    api_key_revoke(api_key=key_a.api_key)
    response = client_a.get(url)
    assert response.status_code == 401
    assert response.data["error"]["type"] == "api_key_revoked"
    assert "revoked" in response.data["error"]["message"]


def test_revoking_the_calling_key_locks_it_out(client_a, key_a):
    assert client_a.post(f"/api/v1/api-keys/{key_a.api_key.public_id}/revoke").status_code == 200
    assert client_a.post("/api/v1/api-keys", {"name": "sneaky"}).status_code == 401
    assert ApiKey.objects.filter(name="sneaky").count() == 0


def test_expired_key_is_refused(org_a, make_bearer_client):
    issued = api_key_create(organization=org_a, name="short", expires_at=timezone.now() + timedelta(minutes=1))
    ApiKey.objects.filter(pk=issued.api_key.pk).update(expires_at=timezone.now() - timedelta(seconds=1))
    response = make_bearer_client(issued.key).get("/api/v1/organization")
    assert response.status_code == 401
    assert response.data["error"]["type"] == "api_key_expired"


@pytest.mark.parametrize(
    "authorization",
    [None, "Bearer", "Bearer dip_nope", "Bearer " + "dip_" + "a" * 38, "Basic dXNlcjpwYXNz", "Bearer a b"],
)
def test_public_endpoints_require_a_valid_key(db, authorization):
    client = APIClient()
    if authorization is not None:
        client.credentials(HTTP_AUTHORIZATION=authorization)
    response = client.get("/api/v1/organization")
    assert response.status_code == 401
    assert set(response.data["error"]) >= {"type", "message"}
    assert response["WWW-Authenticate"].startswith("Bearer")


def test_unknown_key_is_not_recognised(db, make_bearer_client):
    response = make_bearer_client(generate_api_key()).get("/api/v1/organization")
    assert response.status_code == 401
    assert response.data["error"]["type"] == "api_key_not_recognised"


def test_last_used_at_is_recorded_at_most_once_per_resolution(client_a, key_a):
    client_a.get("/api/v1/organization")
    first_use = ApiKey.objects.get(pk=key_a.api_key.pk).last_used_at
    assert first_use is not None
    client_a.get("/api/v1/organization")
    assert ApiKey.objects.get(pk=key_a.api_key.pk).last_used_at == first_use

    ApiKey.objects.filter(pk=key_a.api_key.pk).update(last_used_at=first_use - LAST_USED_AT_RESOLUTION)
    client_a.get("/api/v1/organization")
    assert ApiKey.objects.get(pk=key_a.api_key.pk).last_used_at > first_use
