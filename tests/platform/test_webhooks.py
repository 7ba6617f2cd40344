"""Webhook endpoints on the control plane: create, list, retrieve, delete and rotate as OpenAI's webhook
endpoint objects; admins and owners only; one organization never reaching another's; bad input and URLs
that lead to loopback, private, link-local, multicast or unspecified addresses refused with a 400 naming the
problem; and the gateway's internal endpoint for response events.

Deliveries (tries, retries, signatures, the secret's overlap, batches' events) are test_webhooks_delivery.py's.
"""

import ipaddress
import json

import pytest

from controlplane.tenancy.models import AuditEvent
from controlplane.tenancy.services import api_key_create
from controlplane.webhooks.addresses import refused_kind
from controlplane.webhooks.models import WebhookDelivery, WebhookEndpoint, WebhookEvent
from controlplane.webhooks.services import MAX_ENDPOINTS_PER_ORGANIZATION, emit_event
from tests.platform.conftest import bearer_client
from tests.platform.test_platform_roles import member_client

WEBHOOKS = "/api/v1/webhooks"
PUBLIC_URL = "https://hooks.example.invalid/diptych"  # a name that never resolves: accepted, its tries fail
EVENTS = "/api/v1/internal/webhooks/events"


def create(client, url: str = PUBLIC_URL, event_types=("batch.completed",), **extra):
    return client.post(WEBHOOKS, {"url": url, "event_types": list(event_types), **extra}, format="json")


@pytest.fixture
def endpoint(client_a) -> dict:
    response = create(client_a, event_types=["batch.completed", "batch.cancelled"], name="orders")
    assert response.status_code == 201, response.data
    return response.data


def test_create_answers_the_endpoint_with_its_secret_once(client_a, endpoint, org_a):
    assert endpoint["object"] == "webhook_endpoint" and endpoint["id"].startswith("wh_")
    assert endpoint["url"] == PUBLIC_URL and endpoint["name"] == "orders"
    assert endpoint["event_types"] == ["batch.completed", "batch.cancelled"]
    assert endpoint["signing_secret"].startswith("whsec_")
    assert endpoint["signing_secret_hint"] == f"whsec_…{endpoint['signing_secret'][-4:]}"
    assert endpoint["created_at"] == endpoint["updated_at"]
    shown = client_a.get(f"{WEBHOOKS}/{endpoint['id']}").data
    assert "signing_secret" not in shown
    assert shown == {key: value for key, value in endpoint.items() if key != "signing_secret"}
    listed = client_a.get(WEBHOOKS).data
    assert listed["object"] == "list" and [item["id"] for item in listed["data"]] == [endpoint["id"]]
    assert "signing_secret" not in listed["data"][0]
    assert AuditEvent.objects.filter(organization=org_a, action="webhook_endpoint.create").count() == 1


def test_a_replayed_create_withholds_the_secret(client_a):
    body = {"url": PUBLIC_URL, "event_types": ["batch.completed"]}
    first = client_a.post(WEBHOOKS, body, format="json", HTTP_IDEMPOTENCY_KEY="create-hook-1")
    again = client_a.post(WEBHOOKS, body, format="json", HTTP_IDEMPOTENCY_KEY="create-hook-1")
    assert first.status_code == again.status_code == 201
    assert again.data["id"] == first.data["id"] and first.data["signing_secret"].startswith("whsec_")
    assert again.data["signing_secret"] is None and again["Idempotent-Withheld"] == "signing_secret"
    assert WebhookEndpoint.objects.count() == 1


def test_the_list_pages_newest_first_with_a_cursor(client_a):
    ids = [create(client_a).data["id"] for _ in range(3)]
    first = client_a.get(WEBHOOKS, {"limit": 2}).data
    assert [item["id"] for item in first["data"]] == ids[:0:-1] and first["has_more"]
    rest = client_a.get(WEBHOOKS, {"limit": 2, "after": first["last_id"]}).data
    assert [item["id"] for item in rest["data"]] == ids[:1] and not rest["has_more"]


def test_delete_removes_the_endpoint_with_its_deliveries(client_a, endpoint, org_a):
    emit_event(organization=org_a, event_type="batch.completed", data={"id": "batch_1"})
    assert WebhookDelivery.objects.count() == 1
    response = client_a.delete(f"{WEBHOOKS}/{endpoint['id']}")
    assert response.status_code == 200
    assert response.data == {"id": endpoint["id"], "object": "webhook_endpoint.deleted", "deleted": True}
    assert client_a.get(f"{WEBHOOKS}/{endpoint['id']}").status_code == 404
    assert not WebhookEndpoint.objects.exists() and not WebhookDelivery.objects.exists()


def test_rotate_answers_a_new_secret_and_keeps_the_old_one_for_24_hours(client_a, endpoint):
    url = f"{WEBHOOKS}/{endpoint['id']}/rotate-secret"
    rotated = client_a.post(url, {}, format="json")
    assert rotated.status_code == 200, rotated.data
    assert rotated.data["signing_secret"] != endpoint["signing_secret"]
    stored = WebhookEndpoint.objects.get(public_id=endpoint["id"])
    assert stored.previous_secret == endpoint["signing_secret"]
    assert (stored.previous_secret_until - stored.updated_at).total_seconds() == 24 * 3600
    dropped = client_a.post(url, {"keep_old_secret_active_for_24_hours": False}, format="json")
    stored.refresh_from_db()
    assert stored.secret == dropped.data["signing_secret"] and stored.previous_secret == ""
    assert stored.previous_secret_until is None


def test_another_organization_s_endpoint_is_a_404_and_stays_as_it_was(client_a, client_b, endpoint):
    for method, path in [
        ("get", ""),
        ("delete", ""),
        ("post", "/rotate-secret"),
        ("post", "/test"),
        ("get", "/deliveries"),
    ]:
        response = getattr(client_b, method)(f"{WEBHOOKS}/{endpoint['id']}{path}", {}, format="json")
        assert response.status_code == 404, (method, path, response.data)
        assert response.data["error"]["type"] == "not_found"
    assert client_b.get(WEBHOOKS).data["data"] == []
    stored = WebhookEndpoint.objects.get(public_id=endpoint["id"])
    assert stored.secret == endpoint["signing_secret"] and not WebhookDelivery.objects.exists()


@pytest.mark.parametrize(("role", "allowed"), [("owner", True), ("admin", True), ("developer", False)])
def test_admins_and_owners_manage_endpoints(org_a, role, allowed):
    client, _ = member_client(org_a, role)
    read, write = client.get(WEBHOOKS), create(client)
    assert (read.status_code, write.status_code) == ((200, 201) if allowed else (403, 403))
    if not allowed:
        assert "webhooks:read" in read.data["error"]["message"] and role in read.data["error"]["message"]


def test_a_billing_viewer_may_not_read_endpoints(org_a):
    client, _ = member_client(org_a, "billing_viewer")
    assert client.get(WEBHOOKS).status_code == 403


@pytest.mark.parametrize(
    ("scopes", "read", "write"),
    [(["inference"], 403, 403), (["admin:read"], 200, 403), (["admin:write"], 403, 201)],
)
def test_keys_reach_endpoints_by_their_admin_scopes(org_a, scopes, read, write):
    client = bearer_client(api_key_create(organization=org_a, name="k", scopes=scopes).key)
    assert (client.get(WEBHOOKS).status_code, create(client).status_code) == (read, write)


@pytest.mark.parametrize(
    ("body", "field", "expected"),
    [
        ({"url": PUBLIC_URL, "event_types": ["batch.done"]}, "event_types[0]", "Unknown event type 'batch.done'"),
        ({"url": PUBLIC_URL, "event_types": []}, "event_types", "empty"),
        ({"url": PUBLIC_URL, "event_types": ["batch.failed", "batch.failed"]}, "event_types", "more than once"),
        ({"url": PUBLIC_URL, "event_types": "batch.completed"}, "event_types", "list"),
        ({"event_types": ["batch.completed"]}, "url", "required"),
        ({"url": 12, "event_types": ["batch.completed"]}, "url", "Must be text"),
        ({"url": "not a url", "event_types": ["batch.completed"]}, "url", "must start with https://"),
        ({"url": "ftp://files.example.com/x", "event_types": ["batch.completed"]}, "url", "not 'ftp'"),
        ({"url": "http://hooks.example.com/x", "event_types": ["batch.completed"]}, "url", "https://, not 'http'"),
        ({"url": "https://", "event_types": ["batch.completed"]}, "url", "names no host"),
        ({"url": "https://me:pw@hooks.example.com/", "event_types": ["batch.completed"]}, "url", "user name"),
        ({"url": "https://hooks.example.com/#x", "event_types": ["batch.completed"]}, "url", "fragment"),
        ({"url": "https://x.example.com/" + "a" * 2100, "event_types": ["batch.completed"]}, "url", "2048"),
        ({"url": PUBLIC_URL, "event_types": ["batch.completed"], "name": "n" * 101}, "name", "100"),
        ({"url": PUBLIC_URL, "event_types": ["batch.completed"], "secret": "mine"}, "secret", "Unknown field"),
    ],
)
def test_bad_input_is_a_400_naming_the_field(client_a, body, field, expected):
    response = client_a.post(WEBHOOKS, body, format="json")
    assert response.status_code == 400, response.data
    error = response.data["error"]
    assert error["type"] == "validation_error" and field in error["fields"]
    assert expected in error["message"], error["message"]
    assert not WebhookEndpoint.objects.exists()


@pytest.mark.parametrize(
    ("url", "kind"),
    [
        ("https://127.0.0.1:8443/hooks", "127.0.0.1 is a loopback address"),
        ("https://localhost/hooks", "localhost (127.0.0.1) is a loopback address"),
        ("https://[::1]/hooks", "::1 is a loopback address"),
        ("https://[::ffff:127.0.0.1]/hooks", "is a loopback address"),
        ("https://169.254.169.254/latest/meta-data", "169.254.169.254 is a link-local address"),
        ("https://[fe80::1]/hooks", "is a link-local address"),
        ("https://10.1.2.3/hooks", "10.1.2.3 is a private address"),
        ("https://192.168.0.10/hooks", "is a private address"),
        ("https://[fd00::1]/hooks", "is a private address"),
        ("https://224.0.0.251/hooks", "224.0.0.251 is a multicast address"),
        ("https://0.0.0.0/hooks", "0.0.0.0 is an unspecified address"),
        ("https://100.64.0.1/hooks", "is a non-public address"),
        ("https://[64:ff9b::a00:1]/hooks", "is a private address"),  # NAT64 of 10.0.0.1
    ],
)
def test_urls_leading_off_the_public_internet_are_refused_at_create(client_a, url, kind):
    response = create(client_a, url=url)
    assert response.status_code == 400, response.data
    message = response.data["error"]["message"]
    assert kind in message and "DIPTYCH_WEBHOOKS_ALLOWED_NETWORKS" in message, message
    assert response.data["error"]["fields"] == {"url": [message.removeprefix("url: ")]}
    assert not WebhookEndpoint.objects.exists()


def test_the_operator_allows_networks_by_setting(client_a, settings):
    settings.DIPTYCH_WEBHOOKS_ALLOWED_NETWORKS = ["10.0.0.0/8"]
    assert create(client_a, url="https://10.1.2.3/hooks").status_code == 201
    assert create(client_a, url="https://127.0.0.1/hooks").status_code == 400
    settings.DIPTYCH_WEBHOOKS_ALLOWED_NETWORKS = ["0.0.0.0/0", "::/0"]  # DIPTYCH_WEBHOOKS_ALLOW_PRIVATE=1
    assert create(client_a, url="https://127.0.0.1/hooks").status_code == 201
    assert create(client_a, url="http://127.0.0.1/hooks").status_code == 400  # https still
    settings.DIPTYCH_WEBHOOKS_ALLOW_HTTP = True
    assert create(client_a, url="http://127.0.0.1/hooks").status_code == 201


@pytest.mark.parametrize("address", ["8.8.8.8", "1.1.1.1", "2606:4700:4700::1111", "::ffff:8.8.8.8"])
def test_public_addresses_are_allowed(address):
    assert refused_kind(ipaddress.ip_address(address)) == ""


def test_a_body_over_the_endpoints_limit_is_a_413_in_the_error_shape(client_a):
    body = json.dumps({"url": PUBLIC_URL, "event_types": ["batch.completed"], "name": "x" * 20_000})
    response = client_a.post(WEBHOOKS, body, content_type="application/json")
    assert response.status_code == 413
    assert response.json()["error"]["type"] == "request_too_large"
    assert not WebhookEndpoint.objects.exists()


def test_an_organization_has_a_bounded_number_of_endpoints(client_a):
    for _ in range(MAX_ENDPOINTS_PER_ORGANIZATION):
        assert create(client_a).status_code == 201
    response = create(client_a)
    assert response.status_code == 400 and "at most 20 webhook endpoints" in response.data["error"]["message"]


# ---- events ----------------------------------------------------------------------------------------------


def test_an_event_is_stored_once_with_a_delivery_per_subscribed_endpoint(client_a, endpoint, org_a):
    other = create(client_a, event_types=["batch.expired"]).data
    event = emit_event(organization=org_a, event_type="batch.completed", data={"id": "batch_1"})
    assert event is not None and event.public_id.startswith("evt_")
    assert list(WebhookDelivery.objects.values_list("endpoint__public_id", "status")) == [(endpoint["id"], "pending")]
    again = emit_event(organization=org_a, event_type="batch.completed", data={"id": "batch_1"})
    assert again == event and WebhookDelivery.objects.count() == 1
    assert emit_event(organization=org_a, event_type="response.completed", data={"id": "resp_1"}) is None
    assert WebhookEvent.objects.count() == 1 and other["id"]


def test_the_gateway_emits_response_events(internal_client, client_a, org_a):
    endpoint = create(client_a, event_types=["response.completed"]).data
    body = {"organization_id": org_a.public_id, "type": "response.completed", "data": {"id": "resp_abc"}}
    first = internal_client.post(EVENTS, body, format="json")
    assert first.status_code == 200, first.data
    assert internal_client.post(EVENTS, body, format="json").data == first.data  # a retry: the same event
    (delivery,) = WebhookDelivery.objects.select_related("event", "endpoint")
    assert delivery.event.public_id == first.data["event_id"] and delivery.endpoint.public_id == endpoint["id"]
    assert delivery.event.data == {"id": "resp_abc"}
    ignored = internal_client.post(EVENTS, {**body, "type": "response.failed"}, format="json")
    assert ignored.status_code == 200 and ignored.data == {"event_id": None}


@pytest.mark.parametrize(
    ("overrides", "status"),
    [
        ({"type": "batch.completed"}, 400),  # the control plane emits batches' events itself
        ({"data": {"id": ""}}, 400),
        ({"organization_id": "org_unknown"}, 404),
    ],
)
def test_the_internal_endpoint_refuses_what_is_not_a_response_event(internal_client, org_a, overrides, status):
    body = {"organization_id": org_a.public_id, "type": "response.completed", "data": {"id": "resp_1"}, **overrides}
    response = internal_client.post(EVENTS, body, format="json")
    assert response.status_code == status, response.data


def test_the_internal_endpoint_refuses_an_organization_key(client_a, org_a):
    body = {"organization_id": org_a.public_id, "type": "response.completed", "data": {"id": "resp_1"}}
    assert client_a.post(EVENTS, body, format="json").status_code == 401
