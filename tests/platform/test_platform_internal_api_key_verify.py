from datetime import timedelta

import pytest
from django.utils import timezone

from controlplane.tenancy.api_keys import generate_api_key
from controlplane.tenancy.models import ApiKey
from controlplane.tenancy.services import api_key_create, api_key_revoke

VERIFY_URL = "/api/v1/internal/api-keys/verify"


def test_verify_returns_the_ids_and_records_use(internal_client, key_a, org_a):
    response = internal_client.post(VERIFY_URL, {"api_key": key_a.key})
    assert response.status_code == 200
    defaults = {"requests_per_minute": 500, "input_tokens_per_minute": 200_000, "output_tokens_per_minute": 200_000}
    unlimited = dict.fromkeys(defaults)
    assert response.data == {
        "api_key_id": key_a.api_key.public_id,
        "organization_id": org_a.public_id,
        "project_id": key_a.api_key.project.public_id,
        "kind": "standard",
        "batch_id": None,
        "scopes": ["inference", "admin:read", "admin:write"],
        "expires_at": None,
        "limits": {"organization": defaults, "project": unlimited, "api_key": unlimited},
        "spend": {"limit_micros": None, "spent_micros": 0, "over_limit": False},
        "project_spend": {"limit_micros": None, "spent_micros": 0, "over_limit": False},
    }
    assert ApiKey.objects.get(pk=key_a.api_key.pk).last_used_at is not None


def test_verify_throttles_last_used_at_writes(internal_client, key_a):
    internal_client.post(VERIFY_URL, {"api_key": key_a.key})
    first_use = ApiKey.objects.get(pk=key_a.api_key.pk).last_used_at
    internal_client.post(VERIFY_URL, {"api_key": key_a.key})
    assert ApiKey.objects.get(pk=key_a.api_key.pk).last_used_at == first_use


@pytest.mark.parametrize("candidate", ["dip_short", "sk-" + "a" * 40, " " + "dip_" + "a" * 38])
def test_verify_rejects_malformed_keys(internal_client, db, candidate):
    response = internal_client.post(VERIFY_URL, {"api_key": candidate})
    assert response.status_code == 401
    assert response.data["error"]["type"] == "api_key_malformed"
    assert "Malformed" in response.data["error"]["message"]


def test_verify_rejects_unknown_keys(internal_client, db):
    response = internal_client.post(VERIFY_URL, {"api_key": generate_api_key()})
    assert response.status_code == 401
    assert response.data["error"]["type"] == "api_key_not_recognised"
    assert "not recognised" in response.data["error"]["message"]


def test_verify_rejects_revoked_keys(internal_client, key_a):
    api_key_revoke(api_key=key_a.api_key)
    response = internal_client.post(VERIFY_URL, {"api_key": key_a.key})
    assert response.status_code == 401
    assert response.data["error"]["type"] == "api_key_revoked"
    assert "revoked" in response.data["error"]["message"]


def test_verify_rejects_expired_keys(internal_client, org_a):
    issued = api_key_create(organization=org_a, name="brief", expires_at=timezone.now() + timedelta(hours=1))
    ApiKey.objects.filter(pk=issued.api_key.pk).update(expires_at=timezone.now() - timedelta(seconds=1))
    response = internal_client.post(VERIFY_URL, {"api_key": issued.key})
    assert response.status_code == 401
    assert response.data["error"]["type"] == "api_key_expired"
    assert "expired" in response.data["error"]["message"]
    assert ApiKey.objects.get(pk=issued.api_key.pk).last_used_at is None


@pytest.mark.parametrize("body", [{}, {"api_key": ""}, {"api_key": ["dip_x"]}, {"api_key": None}])
def test_verify_rejects_a_bad_body(internal_client, db, body):
    response = internal_client.post(VERIFY_URL, body)
    assert response.status_code == 400
    assert "api_key" in response.data["error"]["fields"]


def test_verify_reports_limits_expiry_and_spend(internal_client, org_a):
    expires_at = timezone.now() + timedelta(days=1)
    issued = api_key_create(organization=org_a, name="limited", scopes=["inference"], expires_at=expires_at)
    ApiKey.objects.filter(pk=issued.api_key.pk).update(requests_per_minute=60)
    org_a.input_tokens_per_minute = 10_000
    org_a.spend_limit_micros = 0
    org_a.save()
    data = internal_client.post(VERIFY_URL, {"api_key": issued.key}).data
    assert data["scopes"] == ["inference"]
    assert data["expires_at"] == expires_at.isoformat().replace("+00:00", "Z")
    assert data["limits"]["organization"]["input_tokens_per_minute"] == 10_000
    assert data["limits"]["api_key"] == {
        "requests_per_minute": 60,
        "input_tokens_per_minute": None,
        "output_tokens_per_minute": None,
    }
    assert data["spend"] == {"limit_micros": 0, "spent_micros": 0, "over_limit": True}
