"""Roles and scopes: who may call what, session login, CSRF, and the audit log of administrative actions."""

import re

import pytest
from django.core import mail
from rest_framework.test import APIClient

from controlplane.tenancy.access import ROLE_PERMISSIONS, SCOPE_PERMISSIONS
from controlplane.tenancy.models import ApiKey, AuditEvent, Membership
from controlplane.tenancy.services import api_key_create, member_add

PASSWORD = "correct-horse-battery-staple"

# (method, url, body, permission it needs)
ENDPOINTS = [
    ("get", "/api/v1/organization", None, "organization:read"),
    ("get", "/api/v1/models", None, "catalog:read"),
    ("get", "/api/v1/prices", None, "catalog:read"),
    ("get", "/api/v1/usage-events", None, "usage:read"),
    ("get", "/api/v1/usage/summary", None, "usage:read"),
    ("get", "/api/v1/usage/daily?start=2026-01-01&end=2026-01-31", None, "usage:read"),
    ("get", "/api/v1/billing/current", None, "billing:read"),
    ("get", "/api/v1/invoices", None, "billing:read"),
    ("get", "/api/v1/spend-limit", None, "billing:read"),
    ("put", "/api/v1/spend-limit", {"limit_micros": 10}, "spend_limit:write"),
    ("get", "/api/v1/api-keys", None, "keys:read"),
    ("post", "/api/v1/api-keys", {"name": "k", "scopes": ["inference"]}, "keys:write"),
    ("get", "/api/v1/members", None, "members:read"),
    ("post", "/api/v1/members", {"email": "new@acme.test", "role": "developer"}, "members:write"),
    ("get", "/api/v1/audit-log", None, "audit:read"),
]


ENDPOINT_IDS = [f"{method} {url}" for method, url, _, _ in ENDPOINTS]


def mailed_token() -> str:
    """The invitation token in the last email sent (the test email backend keeps them in mail.outbox)."""
    return re.search(r"inv_[0-9A-Za-z]{38}", mail.outbox[-1].body).group(0)


def member_client(organization, role: str, email: str | None = None) -> tuple[APIClient, Membership]:
    membership = member_add(organization=organization, email=email or f"{role}@acme.test", role=role, password=PASSWORD)
    client = APIClient()
    client.force_login(membership.user)
    return client, membership


@pytest.fixture
def owner(org_a):
    return member_client(org_a, "owner")


@pytest.mark.parametrize("role", ["owner", "admin", "developer", "billing_viewer"])
@pytest.mark.parametrize(("method", "url", "body", "permission"), ENDPOINTS, ids=ENDPOINT_IDS)
def test_roles_enforce_the_permission_table(org_a, owner, role, method, url, body, permission):
    client = owner[0] if role == "owner" else member_client(org_a, role)[0]
    response = getattr(client, method)(url, body, format="json")
    if permission in ROLE_PERMISSIONS[role]:
        assert response.status_code in (200, 201), response.data
    else:
        assert response.status_code == 403
        assert response.data["error"]["type"] == "permission_denied"
        assert permission in response.data["error"]["message"] and role in response.data["error"]["message"]


@pytest.mark.parametrize("scopes", [["inference"], ["admin:read"], ["admin:write"], ["admin:read", "admin:write"]])
@pytest.mark.parametrize(("method", "url", "body", "permission"), ENDPOINTS, ids=ENDPOINT_IDS)
def test_api_key_scopes_enforce_the_permission_table(org_a, make_bearer_client, scopes, method, url, body, permission):
    issued = api_key_create(organization=org_a, name="scoped", scopes=scopes)
    response = getattr(make_bearer_client(issued.key), method)(url, body, format="json")
    granted = set().union(*(SCOPE_PERMISSIONS[scope] for scope in scopes))
    if permission in granted:
        assert response.status_code in (200, 201), response.data
    else:
        assert response.status_code == 403
        assert "scopes" in response.data["error"]["message"]


def test_developer_sees_and_revokes_only_own_keys(org_a, key_a):
    client, _membership = member_client(org_a, "developer")
    created = client.post("/api/v1/api-keys", {"name": "mine", "scopes": ["inference", "admin:read"]}, format="json")
    assert created.status_code == 201
    assert [key["id"] for key in client.get("/api/v1/api-keys").data["data"]] == [created.data["id"]]
    assert client.get(f"/api/v1/api-keys/{key_a.api_key.public_id}").status_code == 404
    assert client.post(f"/api/v1/api-keys/{key_a.api_key.public_id}/revoke").status_code == 404
    assert ApiKey.objects.get(pk=key_a.api_key.pk).revoked_at is None
    assert client.post(f"/api/v1/api-keys/{created.data['id']}/revoke").status_code == 200


def test_developer_cannot_mint_admin_write_keys(org_a):
    client, _ = member_client(org_a, "developer")
    response = client.post("/api/v1/api-keys", {"name": "escalate", "scopes": ["admin:write"]}, format="json")
    assert response.status_code == 403
    assert "admin:write" in response.data["error"]["message"]
    assert not ApiKey.objects.filter(name="escalate").exists()


def test_a_key_cannot_mint_scopes_it_lacks(org_a, make_bearer_client):
    writer = api_key_create(organization=org_a, name="writer", scopes=["admin:write"])
    response = make_bearer_client(writer.key).post(
        "/api/v1/api-keys", {"name": "escalate", "scopes": ["inference", "admin:read"]}, format="json"
    )
    assert response.status_code == 403
    assert "admin:read" in response.data["error"]["message"]
    assert not ApiKey.objects.filter(name="escalate").exists()


def test_admin_manages_members_but_not_owners(org_a, owner):
    admin, _ = member_client(org_a, "admin")
    new_owner = {"email": "o2@acme.test", "role": "owner"}
    assert admin.post("/api/v1/members", new_owner).status_code == 403
    owner_id = owner[1].public_id
    assert admin.patch(f"/api/v1/members/{owner_id}", {"role": "developer"}).status_code == 403
    assert admin.delete(f"/api/v1/members/{owner_id}").status_code == 403
    assert admin.post("/api/v1/members", {"email": "d@acme.test", "role": "developer"}).status_code == 201
    accepted = APIClient().post("/api/v1/auth/accept-invitation", {"token": mailed_token(), "password": PASSWORD})
    assert accepted.status_code == 200
    dev_id = Membership.objects.get(user__email="d@acme.test").public_id
    assert admin.patch(f"/api/v1/members/{dev_id}", {"role": "billing_viewer"}).data["role"] == "billing_viewer"
    assert admin.delete(f"/api/v1/members/{dev_id}").status_code == 204
    assert Membership.objects.filter(organization=org_a).count() == 2


def test_the_last_owner_cannot_leave_or_be_demoted(org_a, owner):
    client, membership = owner
    response = client.patch(f"/api/v1/members/{membership.public_id}", {"role": "admin"})
    assert response.status_code == 400
    assert response.data["error"]["type"] == "last_owner"
    assert client.delete(f"/api/v1/members/{membership.public_id}").status_code == 400
    assert Membership.objects.get(pk=membership.pk).role == "owner"


@pytest.mark.parametrize(
    ("body", "field"),
    [
        ({"email": "not-an-email", "role": "developer", "password": PASSWORD}, "email"),
        ({"email": "x@acme.test", "role": "emperor", "password": PASSWORD}, "role"),
        ({"email": "x@acme.test", "role": "developer", "password": PASSWORD}, "password"),
    ],
)
def test_adding_a_member_with_bad_input_changes_nothing(org_a, owner, body, field):
    response = owner[0].post("/api/v1/members", body, format="json")
    assert response.status_code == 400
    assert field in response.data["error"]["fields"]
    assert Membership.objects.filter(organization=org_a).count() == 1


def test_login_me_logout(org_a, owner):
    client = APIClient(enforce_csrf_checks=True)
    bad = client.post("/api/v1/auth/login", {"email": "owner@acme.test", "password": "wrong"}, format="json")
    assert bad.status_code == 401
    assert bad.data["error"]["type"] == "invalid_credentials"
    unknown = client.post("/api/v1/auth/login", {"email": "nobody@acme.test", "password": "wrong"}, format="json")
    assert unknown.status_code == 401 and unknown.data["error"]["message"] == bad.data["error"]["message"]
    assert client.post("/api/v1/auth/login", {"email": "owner@acme.test"}, format="json").status_code == 400

    response = client.post("/api/v1/auth/login", {"email": "OWNER@acme.test", "password": PASSWORD}, format="json")
    assert response.status_code == 200
    expected = {
        "email": "owner@acme.test",
        "is_staff": False,
        "organization": {"id": org_a.public_id, "name": "Acme"},
        "role": "owner",
    }
    assert response.data == {"user": expected}
    assert client.get("/api/v1/auth/me").data == expected

    csrf = client.cookies["csrftoken"].value
    no_token = client.put("/api/v1/spend-limit", {"limit_micros": 1}, format="json")
    assert no_token.status_code == 403 and "CSRF" in no_token.data["error"]["message"]
    with_token = client.put("/api/v1/spend-limit", {"limit_micros": 1}, format="json", HTTP_X_CSRFTOKEN=csrf)
    assert with_token.status_code == 200

    assert client.post("/api/v1/auth/logout", HTTP_X_CSRFTOKEN=csrf).status_code == 204
    assert client.get("/api/v1/auth/me").status_code == 401


def test_me_with_an_api_key(client_a, org_a):
    assert client_a.get("/api/v1/auth/me").data == {
        "email": None,
        "is_staff": False,
        "organization": {"id": org_a.public_id, "name": "Acme"},
        "role": None,
    }


def test_staff_user_without_organization(staff_client):
    assert staff_client.get("/api/v1/auth/me").data == {
        "email": "staff@diptych.local",
        "is_staff": True,
        "organization": None,
        "role": None,
    }
    response = staff_client.get("/api/v1/organization")
    assert response.status_code == 403
    assert "not a member" in response.data["error"]["message"]


def test_audit_log_records_who_did_what_and_only_owners_read_it(org_a, owner, client_a, key_a):
    client, _membership = owner
    created = client_a.post("/api/v1/api-keys", {"name": "audited", "scopes": ["inference"]}, format="json").data
    client.post(f"/api/v1/api-keys/{created['id']}/revoke")
    client.put("/api/v1/spend-limit", {"limit_micros": 7}, format="json")
    client.post("/api/v1/members", {"email": "a@acme.test", "role": "admin"}, format="json")

    log = client.get("/api/v1/audit-log").data
    actions = [(entry["actor"], entry["action"], entry["target_id"]) for entry in reversed(log["data"])]
    assert actions[-4:-1] == [
        (f"api_key:{key_a.api_key.public_id}", "api_key.create", created["id"]),
        ("owner@acme.test", "api_key.revoke", created["id"]),
        ("owner@acme.test", "spend_limit.set", org_a.public_id),
    ]
    assert actions[-1][:2] == ("owner@acme.test", "member.invite")
    assert log["data"][1]["details"] == {"from": None, "to": 7}
    assert client.get("/api/v1/audit-log", {"action": "spend_limit.set"}).data["total"] == 1
    assert client_a.get("/api/v1/audit-log").status_code == 403
    assert AuditEvent.objects.filter(organization=org_a).count() == log["total"]
