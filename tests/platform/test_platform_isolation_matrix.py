"""Every public endpoint × another organization's credentials: never another organization's data or changes.

The cases come from the URL conf, so a new endpoint joins the matrix without touching this file; the only
endpoints left out are listed in EXEMPT with the reason.
"""

import json
import re
from datetime import UTC, datetime

import pytest
from django.urls import URLPattern, URLResolver, get_resolver
from rest_framework.test import APIClient

from controlplane.batches.models import Batch, File
from controlplane.batches.services import batch_create, file_upload
from controlplane.billing.models import Invoice
from controlplane.billing.services import billing_periods_close
from controlplane.catalog.services import price_set
from controlplane.metering.models import UsageEvent
from controlplane.tenancy.models import ApiKey, AuditEvent, Invitation, Membership, Organization, Project
from controlplane.tenancy.project_services import project_create, project_member_add
from controlplane.tenancy.services import api_key_create, member_add, member_invite
from controlplane.webhooks.models import WebhookDelivery, WebhookEndpoint
from controlplane.webhooks.services import emit_event, endpoint_create

API_PREFIX = "api/v1/"
EXEMPT = {
    "schema/": "the OpenAPI schema is public and holds no data",
    "auth/login": "takes credentials, reads no organization",
    "auth/accept-invitation": "takes an invitation token, which names its organization (test_platform_invitations)",
    "stripe/webhook": "authenticated by Stripe's signature, not by an organization (test_platform_stripe)",
}
INTERNAL_PREFIX = "internal/"  # the gateway's and workers' endpoints: an organization's key is refused outright
OWNED_PARAMETERS = {
    "key_id",
    "member_id",
    "invoice_id",
    "invitation_id",
    "file_id",
    "batch_id",
    "webhook_id",
    "project_id",
    "project_member_id",
    "request_id",
}
METHODS = ["get", "post", "put", "patch", "delete"]
PASSWORD = "isolation-password-1"
LONG_AGO = datetime(2020, 1, 1, tzinfo=UTC)


def _api_routes(resolver=None, prefix="") -> list[tuple[str, type]]:
    routes = []
    for pattern in (resolver or get_resolver()).url_patterns:
        route = prefix + str(pattern.pattern)
        if isinstance(pattern, URLResolver):
            routes += _api_routes(pattern, route)
        elif isinstance(pattern, URLPattern) and route.startswith(API_PREFIX):
            view_class = getattr(pattern.callback, "view_class", None)
            routes.append((route.removeprefix(API_PREFIX), view_class))
    return routes


ROUTES = _api_routes()
CASES = [
    (route, method)
    for route, view_class in ROUTES
    if route not in EXEMPT and not route.startswith(INTERNAL_PREFIX)
    for method in METHODS
    if hasattr(view_class, method)
]
INTERNAL_CASES = [
    (route, method)
    for route, view_class in ROUTES
    if route.startswith(INTERNAL_PREFIX)
    for method in METHODS
    if hasattr(view_class, method)
]
BODIES = {
    ("members/<str:member_id>", "patch"): {"role": "developer"},
    ("spend-limit", "put"): {"limit_micros": 1},
}


def test_exemptions_name_real_endpoints_and_the_matrix_is_not_empty():
    assert set(EXEMPT) <= {route for route, _ in ROUTES}
    assert len(CASES) >= 25


@pytest.fixture
def organization_a_world(db, org_a, key_a, tiny_model, internal_client, make_usage_event, prefill_client):
    """Organization A with a member, an invoice, usage and a worker; returns the ids B must never see."""
    for phase, micros in (("prefill", 1_000), ("cached_prefill", 500), ("decode", 2_000)):
        price_set(model=tiny_model, phase=phase, micros_per_million=micros, effective_from=LONG_AGO)
    member = member_add(organization=org_a, email="a-owner@acme.test", role="owner", password=PASSWORD)
    invitation = member_invite(organization=org_a, email="a-invitee@acme.test", role="developer").invitation
    event = make_usage_event(
        key_a,
        "req-a-secret",
        "decode",
        started_at="2020-03-04T05:06:07Z",
        finished_at="2020-03-04T05:06:08Z",
        cached_tokens=0,
    )
    assert internal_client.post("/api/v1/internal/usage-events", {"events": [event]}).status_code == 200
    (invoice,) = billing_periods_close()
    worker = prefill_client.post("/api/v1/internal/workers/register", {"address": "127.0.0.1:1", "name": "w"}).data
    line = {"custom_id": "a-1", "method": "POST", "url": "/v1/completions", "body": {"model": tiny_model.name}}
    file = file_upload(organization=org_a, filename="a.jsonl", content=json.dumps(line).encode(), purpose="batch")
    batch = batch_create(
        organization=org_a, input_file_id=file.public_id, endpoint="/v1/completions", completion_window="24h"
    )
    webhook = endpoint_create(
        organization=org_a, url="https://hooks.a-secret.invalid/in", event_types=["batch.completed"]
    )
    emit_event(organization=org_a, event_type="batch.completed", data={"id": batch.public_id})
    project = project_create(organization=org_a, name="a-secret-project")
    project_member = project_member_add(project=project, membership=member, role="member")
    return {
        "project_id": project.public_id,
        "project_member_id": project_member.public_id,
        "file_id": file.public_id,
        "batch_id": batch.public_id,
        "webhook_id": webhook.public_id,
        "webhook_secret": webhook.secret,
        "key_id": key_a.api_key.public_id,
        "member_id": member.public_id,
        "invitation_id": invitation.public_id,
        "invoice_id": invoice.public_id,
        "worker_id": worker["id"],
        "name": tiny_model.name,
        "model": tiny_model.name,
        "revision": "r1",
        "path": "config.json",
        "organization_id": org_a.public_id,
        "request_id": "req-a-secret",
        "response_id": f"resp_{'0' * 32}",  # the internal endpoints' (stored responses: test_responses_store.py)
    }


def _fingerprint(organization: Organization) -> tuple:
    return (
        sorted(ApiKey.objects.filter(organization=organization).values_list("public_id", "revoked_at", "scopes")),
        sorted(Membership.objects.filter(organization=organization).values_list("public_id", "role")),
        sorted(Invitation.objects.filter(organization=organization).values_list("public_id", "role")),
        Organization.objects.get(pk=organization.pk).spend_limit_micros,
        sorted(Invoice.objects.filter(organization=organization).values_list("public_id", "status")),
        UsageEvent.objects.filter(organization=organization).count(),
        AuditEvent.objects.filter(organization=organization).count(),
        sorted(File.objects.filter(organization=organization).values_list("public_id", "bytes")),
        sorted(Batch.objects.filter(organization=organization).values_list("public_id", "status")),
        sorted(WebhookEndpoint.objects.filter(organization=organization).values_list("public_id", "url", "secret")),
        WebhookDelivery.objects.filter(endpoint__organization=organization).count(),
        sorted(Project.objects.filter(organization=organization).values_list("public_id", "name", "archived_at")),
    )


# The catalog's, shared by every organization: a model's name, revision and file paths, and worker ids.
PUBLIC_WORLD_KEYS = ("name", "model", "revision", "path", "worker_id")


@pytest.fixture(params=["api_key", "owner_session"])
def client_of_b(request, org_b):
    if request.param == "api_key":
        issued = api_key_create(organization=org_b, name="b-all", scopes=["inference", "admin:read", "admin:write"])
        client = APIClient()
        client.credentials(HTTP_AUTHORIZATION=f"Bearer {issued.key}")
        return client
    membership = member_add(organization=org_b, email="b-owner@bravo.test", role="owner", password=PASSWORD)
    client = APIClient()
    client.force_login(membership.user)
    return client


@pytest.mark.parametrize(("route", "method"), CASES, ids=[f"{m.upper()} {r}" for r, m in CASES])
def test_another_organization_sees_and_changes_nothing(organization_a_world, org_a, client_of_b, route, method):
    parameters = re.findall(r"<(?:\w+:)?(\w+)>", route)
    url = "/" + API_PREFIX + re.sub(r"<(?:\w+:)?(\w+)>", lambda m: organization_a_world[m.group(1)], route)
    before = _fingerprint(org_a)
    response = getattr(client_of_b, method)(url, BODIES.get((route, method), {}), format="json")

    if OWNED_PARAMETERS & set(parameters):
        assert response.status_code in (403, 404), (url, response.status_code)
    assert response.status_code != 500
    body = response.content.decode()
    # A 404 may echo the id the caller sent; anything else of A's in the answer is a leak.
    secrets_of_a = {k: v for k, v in organization_a_world.items() if k not in PUBLIC_WORLD_KEYS and k not in parameters}
    leaked = {name for name, value in secrets_of_a.items() if value in body}
    assert not leaked, f"{method.upper()} {url} leaked {leaked}"
    assert _fingerprint(org_a) == before


@pytest.mark.parametrize(("route", "method"), INTERNAL_CASES, ids=[f"{m.upper()} {r}" for r, m in INTERNAL_CASES])
def test_internal_endpoints_refuse_organization_keys(organization_a_world, client_a, route, method):
    url = "/" + API_PREFIX + re.sub(r"<(?:\w+:)?(\w+)>", lambda m: organization_a_world[m.group(1)], route)
    response = getattr(client_a, method)(url, {}, format="json")
    assert response.status_code == 401
