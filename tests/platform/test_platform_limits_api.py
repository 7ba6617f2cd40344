"""Rate limits over the REST API: members read their organization's and its keys' limits, admins set them,
bad input is a 400 naming the field and changes nothing, other organizations' keys are not found, and the
gateway's key verification carries a change at once."""

import importlib

import pytest
from django.apps import apps as django_apps
from django.core.exceptions import ImproperlyConfigured
from rest_framework.test import APIClient

from controlplane.settings import rate_limit_from_env
from controlplane.tenancy.models import ApiKey, AuditEvent, Organization
from controlplane.tenancy.services import api_key_create
from tests.platform.test_platform_roles import member_client

LIMIT_FIELDS = ("requests_per_minute", "input_tokens_per_minute", "output_tokens_per_minute")


def limits_of(holder) -> dict:
    holder.refresh_from_db()
    return {name: getattr(holder, name) for name in LIMIT_FIELDS}


@pytest.fixture
def key(org_a) -> ApiKey:
    return api_key_create(organization=org_a, name="limited", scopes=["inference"]).api_key


DEFAULTS = {"requests_per_minute": 500, "input_tokens_per_minute": 200_000, "output_tokens_per_minute": 200_000}


def test_a_new_organization_starts_with_the_default_limits_and_its_keys_unlimited(client_a, org_a, key):
    response = client_a.get("/api/v1/limits")
    assert response.status_code == 200
    assert response.json() == {"organization_id": org_a.public_id, **DEFAULTS, "spend_limit_micros": None}
    assert limits_of(key) == dict.fromkeys(LIMIT_FIELDS)


def test_the_default_limits_are_a_setting(settings, key_a):
    settings.DIPTYCH_DEFAULT_RATE_LIMITS = {**DEFAULTS, "requests_per_minute": 60, "output_tokens_per_minute": None}
    organization = Organization.objects.create(name="Other", slug="other")
    assert limits_of(organization) == {**DEFAULTS, "requests_per_minute": 60, "output_tokens_per_minute": None}
    assert limits_of(key_a.api_key.organization) == DEFAULTS  # made before: unchanged


def test_reading_unlimited_shows_null(client_a, org_a):
    assert client_a.patch("/api/v1/limits", dict.fromkeys(LIMIT_FIELDS), format="json").status_code == 200
    response = client_a.get("/api/v1/limits")
    assert response.json() == {
        "organization_id": org_a.public_id,
        **dict.fromkeys(LIMIT_FIELDS),
        "spend_limit_micros": None,
    }


def test_an_admin_sets_some_organization_limits_and_leaves_the_others(client_a, org_a):
    org_a.output_tokens_per_minute = 500
    org_a.save()
    response = client_a.patch(
        "/api/v1/limits", {"requests_per_minute": 60, "input_tokens_per_minute": 10_000}, format="json"
    )
    assert response.status_code == 200, response.json()
    assert response.json()["requests_per_minute"] == 60
    assert limits_of(org_a) == {
        "requests_per_minute": 60,
        "input_tokens_per_minute": 10_000,
        "output_tokens_per_minute": 500,
    }
    event = AuditEvent.objects.get(action="rate_limits.set")
    assert event.target_id == org_a.public_id and event.details["to"]["requests_per_minute"] == 60
    cleared = client_a.patch("/api/v1/limits", {"output_tokens_per_minute": None}, format="json")
    assert cleared.status_code == 200 and cleared.json()["output_tokens_per_minute"] is None


def test_an_admin_sets_a_key_limit_which_shows_in_the_key_list(client_a, key):
    response = client_a.patch(f"/api/v1/api-keys/{key.public_id}/limits", {"requests_per_minute": 3}, format="json")
    assert response.status_code == 200, response.json()
    assert response.json() == {
        "api_key_id": key.public_id,
        "requests_per_minute": 3,
        "input_tokens_per_minute": None,
        "output_tokens_per_minute": None,
    }
    assert client_a.get(f"/api/v1/api-keys/{key.public_id}/limits").json()["requests_per_minute"] == 3
    listed = {k["id"]: k for k in client_a.get("/api/v1/api-keys").json()["data"]}
    assert listed[key.public_id]["limits"]["requests_per_minute"] == 3


BAD_BODIES = [
    ({"requests_per_minute": -1}, "requests_per_minute", "greater than or equal to 0"),
    ({"requests_per_minute": 1.5}, "requests_per_minute", "whole number"),
    ({"requests_per_minute": 5.0}, "requests_per_minute", "whole number"),
    ({"requests_per_minute": "5"}, "requests_per_minute", "whole number"),
    ({"requests_per_minute": True}, "requests_per_minute", "whole number"),
    ({"requests_per_minute": 2**31}, "requests_per_minute", "less than or equal to 2147483647"),
    ({"input_tokens_per_minute": 10**15 + 1}, "input_tokens_per_minute", "less than or equal to"),
    ({"output_tokens_per_minute": 10**30}, "output_tokens_per_minute", "less than or equal to"),
    ({"requests_per_minute": 5, "tokens_per_minute": 5}, "tokens_per_minute", "Unknown field"),
    ({}, None, "Give at least one of requests_per_minute"),
]


@pytest.mark.parametrize(("body", "field", "words"), BAD_BODIES, ids=[str(b) for b, _, _ in BAD_BODIES])
@pytest.mark.parametrize("target", ["organization", "api key"])
def test_bad_limits_are_refused_naming_the_field_and_change_nothing(client_a, org_a, key, target, body, field, words):
    holder, url = (
        (org_a, "/api/v1/limits") if target == "organization" else (key, f"/api/v1/api-keys/{key.public_id}/limits")
    )
    before = limits_of(holder)
    response = client_a.patch(url, body, format="json")
    assert response.status_code == 400, response.json()
    error = response.json()["error"]
    assert error["type"] == "validation_error"
    assert words in error["message"]
    if field is not None:
        assert error["message"].startswith(f"{field}: ") and field in error["fields"]
    assert limits_of(holder) == before
    assert not AuditEvent.objects.filter(action="rate_limits.set").exists()


def test_the_spend_limit_is_read_here_but_set_at_its_own_endpoint(client_a, org_a):
    org_a.spend_limit_micros = 5_000_000
    org_a.save()
    assert client_a.get("/api/v1/limits").json()["spend_limit_micros"] == 5_000_000
    response = client_a.patch("/api/v1/limits", {"spend_limit_micros": 1}, format="json")
    assert response.status_code == 400
    assert response.json()["error"]["fields"] == {
        "spend_limit_micros": ["Set the spend limit with PUT /api/v1/spend-limit."]
    }
    org_a.refresh_from_db()
    assert org_a.spend_limit_micros == 5_000_000


def test_a_body_that_is_not_an_object_is_refused(client_a, org_a):
    response = client_a.patch("/api/v1/limits", [1, 2], format="json")
    assert response.status_code == 400 and response.json()["error"]["type"] == "validation_error"


@pytest.mark.parametrize("role", ["owner", "admin", "developer", "billing_viewer"])
def test_members_read_and_only_admins_write(org_a, key, role):
    client, membership = member_client(org_a, role)
    own_key = api_key_create(organization=org_a, name="own", scopes=["inference"]).api_key
    own_key.created_by = membership.user
    own_key.save()
    assert client.get("/api/v1/limits").status_code == 200
    assert client.get(f"/api/v1/api-keys/{own_key.public_id}/limits").status_code == 200
    for url in ("/api/v1/limits", f"/api/v1/api-keys/{own_key.public_id}/limits"):
        response = client.patch(url, {"requests_per_minute": 7}, format="json")
        if role in ("owner", "admin"):
            assert response.status_code == 200, response.json()
        else:
            assert response.status_code == 403
            assert "limits:write" in response.json()["error"]["message"]
    changed = role in ("owner", "admin")
    assert limits_of(org_a)["requests_per_minute"] == (7 if changed else DEFAULTS["requests_per_minute"])
    assert limits_of(own_key)["requests_per_minute"] == (7 if changed else None)


def test_a_developer_reads_only_the_limits_of_its_own_keys(org_a, key):
    client, _ = member_client(org_a, "developer")
    assert client.get(f"/api/v1/api-keys/{key.public_id}/limits").status_code == 404


@pytest.mark.parametrize(("scopes", "can_write"), [(["admin:read"], False), (["admin:read", "admin:write"], True)])
def test_api_key_scopes_decide_too(org_a, key, make_bearer_client, scopes, can_write):
    client = make_bearer_client(api_key_create(organization=org_a, name="admin", scopes=scopes).key)
    assert client.get("/api/v1/limits").status_code == 200
    response = client.patch(f"/api/v1/api-keys/{key.public_id}/limits", {"requests_per_minute": 1}, format="json")
    assert response.status_code == (200 if can_write else 403)


def test_another_organizations_key_is_not_found_and_unchanged(client_b, key):
    for method, body in (("get", None), ("patch", {"requests_per_minute": 1})):
        response = getattr(client_b, method)(f"/api/v1/api-keys/{key.public_id}/limits", body, format="json")
        assert response.status_code == 404
        assert response.json()["error"]["type"] == "not_found"
    assert limits_of(key)["requests_per_minute"] is None


def test_each_organization_sees_and_sets_its_own_limits(client_a, client_b, org_a, org_b):
    assert client_b.patch("/api/v1/limits", {"requests_per_minute": 9}, format="json").status_code == 200
    assert client_a.get("/api/v1/limits").json()["requests_per_minute"] == DEFAULTS["requests_per_minute"]
    assert limits_of(org_b)["requests_per_minute"] == 9 and limits_of(org_a) == DEFAULTS


def test_the_gateways_key_verification_carries_a_change_at_once(client_a, internal_client, key_a, org_a):
    key = key_a.api_key
    client_a.patch("/api/v1/limits", {"input_tokens_per_minute": 1000}, format="json")
    client_a.patch(f"/api/v1/api-keys/{key.public_id}/limits", {"requests_per_minute": 2}, format="json")
    verified = internal_client.post("/api/v1/internal/api-keys/verify", {"api_key": key_a.key}, format="json")
    assert verified.status_code == 200
    limits = verified.json()["limits"]
    assert limits["organization"]["input_tokens_per_minute"] == 1000
    assert limits["api_key"]["requests_per_minute"] == 2


def test_unauthenticated_callers_are_refused(org_a):
    response = APIClient().patch("/api/v1/limits", {"requests_per_minute": 1}, format="json")
    assert response.status_code in (401, 403) and "error" in response.json()
    assert limits_of(org_a) == DEFAULTS


@pytest.mark.parametrize(("raw", "limit"), [("", 500), ("  ", 500), ("60", 60), ("0", 0), ("unlimited", None)])
def test_a_default_limit_in_the_environment(monkeypatch, raw, limit):
    monkeypatch.setenv("DIPTYCH_DEFAULT_REQUESTS_PER_MINUTE", raw)
    assert rate_limit_from_env("DIPTYCH_DEFAULT_REQUESTS_PER_MINUTE", 500) == limit


@pytest.mark.parametrize("raw", ["-1", "1.5", "lots", "Unlimited", "2147483648", "٣"])
def test_a_bad_default_limit_in_the_environment_is_refused_by_name(monkeypatch, raw):
    monkeypatch.setenv("DIPTYCH_DEFAULT_INPUT_TOKENS_PER_MINUTE", raw)
    with pytest.raises(ImproperlyConfigured, match=r"DIPTYCH_DEFAULT_INPUT_TOKENS_PER_MINUTE must be a whole number"):
        rate_limit_from_env("DIPTYCH_DEFAULT_INPUT_TOKENS_PER_MINUTE", 500)


def test_organizations_that_never_set_limits_get_the_defaults_and_the_others_keep_theirs(client_a, org_a, org_b):
    """The migration that brought the defaults: an organization made before them (all three null, never set)
    gets them; one that chose unlimited through the API and one with limits of its own keep theirs."""
    migration = importlib.import_module("controlplane.tenancy.migrations.0004_organization_default_rate_limits")
    never_set = Organization.objects.create(name="Old", slug="old", **dict.fromkeys(LIMIT_FIELDS))
    assert client_a.patch("/api/v1/limits", dict.fromkeys(LIMIT_FIELDS), format="json").status_code == 200
    Organization.objects.filter(pk=org_b.pk).update(requests_per_minute=7, input_tokens_per_minute=None)
    migration.default_limits_for_organizations_that_never_set_any(django_apps, None)
    assert limits_of(never_set) == DEFAULTS
    assert limits_of(org_a) == dict.fromkeys(LIMIT_FIELDS)
    assert limits_of(org_b) == {**DEFAULTS, "requests_per_minute": 7, "input_tokens_per_minute": None}
