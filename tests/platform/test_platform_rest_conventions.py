"""Conventions every endpoint keeps, checked over the schema rather than endpoint by endpoint: the index and
the docs, internal endpoints out of the public schema, Idempotency-Key on every POST, unknown query
parameters refused, an object at the top of every response, and one way of counting cached tokens."""

import json
import re
import threading
from datetime import timedelta

import pytest
from django.core.files.uploadedfile import SimpleUploadedFile
from django.db import connection
from django.test.client import encode_multipart
from rest_framework.parsers import JSONParser
from rest_framework.request import Request
from rest_framework.test import APIClient, APIRequestFactory

from controlplane.batches.models import File
from controlplane.billing.services import usage_rollup
from controlplane.common.idempotency import LEASE, request_fingerprint
from controlplane.common.openapi import full_schema
from controlplane.idempotency.models import IdempotencyRecord
from controlplane.idempotency.services import idempotency_key_claim
from controlplane.tenancy.access import Principal
from controlplane.tenancy.models import ApiKey, Invitation
from controlplane.tenancy.services import api_key_create
from tests.platform.test_platform_roles import member_client

INGEST_URL = "/api/v1/internal/usage-events"
# POSTs that take no Idempotency-Key: they sign a browser in or out (nothing to replay), or are Stripe's.
NOT_IDEMPOTENT_POSTS = {
    "/api/v1/auth/login",
    "/api/v1/auth/accept-invitation",
    "/api/v1/auth/logout",
    "/api/v1/stripe/webhook",
}


def public_schema() -> dict:
    response = APIClient().get("/api/v1/schema/", HTTP_ACCEPT="application/vnd.oai.openapi+json")
    assert response.status_code == 200
    return response.json()


def operations(schema: dict, method: str):
    for path, path_item in schema["paths"].items():
        if method in path_item:
            yield path, path_item[method]


def with_dummy_ids(path: str) -> str:
    return re.sub(r"\{\w+\}", "x", path)


# ---- index, docs, schema ------------------------------------------------------------------------------


def test_index_names_the_resources_and_the_docs(db):
    response = APIClient().get("/api/v1/")
    assert response.status_code == 200
    index = response.json()
    assert index["object"] == "api"
    assert index["docs_url"] == "http://testserver/api/v1/docs/"
    assert index["resources"]["api-keys"] == "http://testserver/api/v1/api-keys"
    assert {"usage/summary", "usage/daily", "invoices", "batches"} <= set(index["resources"])
    assert not [name for name in index["resources"] if name.startswith("internal")]
    assert APIClient().get(index["schema_url"]).status_code == 200


def test_docs_page_loads_its_scripts_and_styles_from_this_server(db):
    page = APIClient().get("/api/v1/docs/")
    assert page.status_code == 200
    html = page.content.decode()
    assets = re.findall(r'(?:src|href)="([^"]+)"', html)
    assert len(assets) >= 3 and "swagger-ui-bundle.js" in html
    for asset in assets:
        assert asset.startswith("/api/v1/docs/assets/"), asset
        served = APIClient().get(asset)
        assert served.status_code == 200, asset
        assert b"".join(served.streaming_content)
    assert APIClient().get("/api/v1/docs/assets/../../../settings.py").status_code == 404


def test_internal_endpoints_are_left_out_of_the_public_schema(db):
    public_paths = set(public_schema()["paths"])
    internal = {path for path in full_schema()["paths"] if path.startswith("/api/v1/internal/")}
    assert "/api/v1/internal/usage-events" in internal and "/api/v1/internal/workers/register" in internal
    assert not public_paths & internal
    assert {"/api/v1/api-keys", "/api/v1/usage/summary", "/api/v1/usage/daily"} <= public_paths


# ---- an object at the top of every response ------------------------------------------------------------


def _resolve(schema: dict, node: dict) -> dict:
    while "$ref" in node:
        node = schema["components"]["schemas"][node["$ref"].rsplit("/", 1)[-1]]
    return node


def test_every_json_response_is_an_object(db):
    schema = full_schema()
    for path, path_item in schema["paths"].items():
        for method, operation in path_item.items():
            for code, response in operation["responses"].items():
                body = response.get("content", {}).get("application/json")
                if body is not None:
                    assert _resolve(schema, body["schema"]).get("type") == "object", f"{method} {path} {code}"


def test_usage_summary_is_a_list_object(client_a):
    response = client_a.get("/api/v1/usage/summary")
    assert response.status_code == 200
    assert response.data == {"object": "list", "data": []}


# ---- unknown query parameters ----------------------------------------------------------------------------


@pytest.mark.parametrize("method", ["get", "post"])
def test_every_operation_refuses_an_unknown_query_parameter(client_a, method):
    paths = [path for path, _ in operations(full_schema(), method)]
    assert paths
    for path in paths:
        response = getattr(client_a, method)(f"{with_dummy_ids(path)}?stauts=open")
        assert response.status_code == 400, path
        error = response.json()["error"]
        assert list(error["fields"]) == ["stauts"], path
        assert error["message"].startswith("Unknown query parameter stauts:"), path


def test_declared_query_parameters_are_taken(client_a):
    response = client_a.get("/api/v1/invoices", {"status": "open", "limit": 5, "offset": 0})
    assert response.status_code == 200, response.data
    assert client_a.get("/api/v1/schema/", {"format": "json"}).status_code == 200


def test_the_refusal_names_what_the_endpoint_accepts(client_a):
    response = client_a.get("/api/v1/invoices", {"state": "open"})
    assert response.status_code == 400
    assert response.json()["error"]["fields"] == {
        "state": ["Unknown query parameter; this endpoint accepts limit, offset, status."]
    }


# ---- Idempotency-Key ---------------------------------------------------------------------------------------


def test_every_public_post_documents_idempotency_key(db):
    documented, undocumented = set(), set()
    for path, operation in operations(public_schema(), "post"):
        headers = {p["name"] for p in operation.get("parameters", []) if p["in"] == "header"}
        (documented if "Idempotency-Key" in headers else undocumented).add(path)
    assert undocumented == NOT_IDEMPOTENT_POSTS
    assert {"/api/v1/api-keys", "/api/v1/members", "/api/v1/batches", "/api/v1/prices"} <= documented


def create_key(client: APIClient, name: str, key: str | None = "key-1", path: str = "/api/v1/api-keys"):
    headers = {} if key is None else {"HTTP_IDEMPOTENCY_KEY": key}
    return client.post(path, {"name": name}, format="json", **headers)


def test_a_retry_with_the_same_key_gets_the_stored_response_with_its_secret_withheld(client_a, org_a):
    before = ApiKey.objects.filter(organization=org_a).count()
    first = create_key(client_a, "ci")
    retry = create_key(client_a, "ci")
    assert first.status_code == retry.status_code == 201
    assert first.json()["key"].startswith("dip_")
    assert retry.json() == {**first.json(), "key": None}  # the one key, its secret shown only once
    assert retry["Idempotent-Replayed"] == "true" and "Idempotent-Replayed" not in first
    assert retry["Idempotent-Withheld"] == "key" and "Idempotent-Withheld" not in first
    assert ApiKey.objects.filter(organization=org_a).count() == before + 1


def test_a_stored_response_never_holds_a_secret(client_a, org_a):
    secret = create_key(client_a, "ci").json()["key"]
    record = IdempotencyRecord.objects.get(organization=org_a, key="key-1")
    assert secret not in json.dumps(record.response)
    assert record.response["body"]["key"] is None and record.response["withheld"] == ["key"]


def test_another_caller_with_the_same_key_and_request_gets_neither_answer_nor_key(org_a):
    """A developer may not mint admin keys; replaying the owner's request with the owner's key must not
    hand the developer the owner's answer (the handler's scope check does not run on a replay)."""
    owner, _ = member_client(org_a, "owner")
    developer, _ = member_client(org_a, "developer")
    body = {"name": "ops", "scopes": ["inference", "admin:read", "admin:write"]}
    first = owner.post("/api/v1/api-keys", body, format="json", HTTP_IDEMPOTENCY_KEY="K")
    assert first.status_code == 201
    keys_before = ApiKey.objects.count()
    replay = developer.post("/api/v1/api-keys", body, format="json", HTTP_IDEMPOTENCY_KEY="K")
    assert replay.status_code == 400, replay.json()
    assert replay.json()["error"]["type"] == "idempotency_key_conflict"
    assert "another caller" in replay.json()["error"]["message"] and "'K'" in replay.json()["error"]["message"]
    assert first.json()["id"] not in replay.content.decode() and "Idempotent-Replayed" not in replay
    assert ApiKey.objects.count() == keys_before


def test_another_api_key_of_the_organization_meets_a_conflict_even_while_the_first_runs(
    org_a, key_a, make_bearer_client
):
    other = make_bearer_client(api_key_create(organization=org_a, name="other", scopes=key_a.api_key.scopes).key)
    claim_in_flight(org_a, caller=Principal.of_api_key(key_a.api_key).authority)
    response = create_key(other, "ci")
    assert response.status_code == 400
    assert response.json()["error"]["type"] == "idempotency_key_conflict"


def test_a_member_whose_role_changed_does_not_get_the_answer_made_under_the_old_role(org_a):
    owner, membership = member_client(org_a, "owner")
    member_client(org_a, "owner", email="second-owner@acme.test")  # the last owner cannot be demoted
    assert owner.post("/api/v1/api-keys", {"name": "ci"}, format="json", HTTP_IDEMPOTENCY_KEY="K").status_code == 201
    membership.role = "admin"
    membership.save()
    replay = owner.post("/api/v1/api-keys", {"name": "ci"}, format="json", HTTP_IDEMPOTENCY_KEY="K")
    assert replay.status_code == 400
    assert replay.json()["error"]["type"] == "idempotency_key_conflict"


def test_without_a_key_two_posts_create_two(client_a, org_a):
    before = ApiKey.objects.filter(organization=org_a).count()
    create_key(client_a, "ci", key=None)
    create_key(client_a, "ci", key=None)
    assert ApiKey.objects.filter(organization=org_a).count() == before + 2


def test_the_same_key_with_another_body_or_path_is_refused(client_a, org_a):
    create_key(client_a, "ci")
    before = (ApiKey.objects.count(), Invitation.objects.count())
    other_body = create_key(client_a, "another name")
    assert other_body.status_code == 400
    assert other_body.json()["error"]["type"] == "idempotency_key_reused"
    assert "'key-1'" in other_body.json()["error"]["message"]
    other_path = client_a.post(
        "/api/v1/members", {"email": "x@acme.test", "role": "developer"}, format="json", HTTP_IDEMPOTENCY_KEY="key-1"
    )
    assert other_path.status_code == 400
    assert other_path.json()["error"]["type"] == "idempotency_key_reused"
    assert (ApiKey.objects.count(), Invitation.objects.count()) == before


def test_the_same_json_in_another_key_order_is_the_same_request(client_a):
    first = client_a.post(
        "/api/v1/api-keys",
        '{"name": "ci", "scopes": ["inference"]}',
        content_type="application/json",
        HTTP_IDEMPOTENCY_KEY="k",
    )
    retry = client_a.post(
        "/api/v1/api-keys",
        '{"scopes":["inference"],"name":"ci"}',
        content_type="application/json",
        HTTP_IDEMPOTENCY_KEY="k",
    )
    assert first.status_code == 201 and retry["Idempotent-Replayed"] == "true"


def test_keys_are_kept_per_organization(client_a, client_b, org_a, org_b):
    assert create_key(client_a, "ci").status_code == 201
    from_b = create_key(client_b, "ci")
    assert from_b.status_code == 201 and "Idempotent-Replayed" not in from_b
    assert from_b.json()["id"] != create_key(client_a, "ci").json()["id"]


def claim_in_flight(organization, caller: str) -> None:
    """What the first of two identical requests holds while it runs: the key claimed, nothing stored yet."""
    first = Request(APIRequestFactory().post("/api/v1/api-keys", {"name": "ci"}, format="json"), [JSONParser()])
    idempotency_key_claim(
        organization_id=organization.public_id,
        key="key-1",
        caller=caller,
        fingerprint=request_fingerprint(first),
        execution_id="post_first",
        lease=LEASE,
    )


def test_a_key_still_in_flight_answers_409_and_changes_nothing(client_a, org_a, key_a):
    claim_in_flight(org_a, caller=Principal.of_api_key(key_a.api_key).authority)
    before = ApiKey.objects.count()
    response = create_key(client_a, "ci")
    assert response.status_code == 409
    assert response.json()["error"]["type"] == "idempotency_key_in_use"
    assert "'key-1'" in response.json()["error"]["message"]
    assert ApiKey.objects.count() == before


def test_a_failed_request_frees_its_key(client_a, org_a):
    refused = client_a.post("/api/v1/api-keys", {"name": ""}, format="json", HTTP_IDEMPOTENCY_KEY="key-1")
    assert refused.status_code == 400
    assert not IdempotencyRecord.objects.filter(organization=org_a, key="key-1").exists()
    assert create_key(client_a, "ci").status_code == 201


def test_a_stored_response_is_kept_24_hours(client_a, org_a):
    first = create_key(client_a, "ci")
    record = IdempotencyRecord.objects.get(organization=org_a, key="key-1")
    assert record.response == {"status": 201, "body": {**first.json(), "key": None}, "withheld": ["key"]}
    record.created_at -= timedelta(hours=24, seconds=1)
    record.save()
    again = create_key(client_a, "ci")
    assert again.status_code == 201 and "Idempotent-Replayed" not in again
    assert again.json()["id"] != first.json()["id"]


@pytest.mark.parametrize("key", ["", "x" * 256, "clé", "tab\there"])
def test_a_malformed_key_is_refused(client_a, key):
    before = ApiKey.objects.count()
    response = create_key(client_a, "ci", key=key)
    assert response.status_code == 400
    assert response.json()["error"]["type"] == "invalid_idempotency_key"
    assert "Idempotency-Key" in response.json()["error"]["message"]
    assert ApiKey.objects.count() == before


@pytest.mark.django_db(transaction=True)
def test_concurrent_posts_with_one_key_create_one(key_a, org_a):
    if connection.vendor == "sqlite":
        pytest.skip("concurrent writers need PostgreSQL (DATABASE_URL)")
    answers: list[int] = []
    barrier = threading.Barrier(4)

    def post() -> None:
        client = APIClient()
        client.credentials(HTTP_AUTHORIZATION=f"Bearer {key_a.key}")
        barrier.wait()
        answers.append(create_key(client, "ci").status_code)
        connection.close()

    threads = [threading.Thread(target=post) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert ApiKey.objects.filter(organization=org_a, name="ci").count() == 1
    assert answers.count(201) >= 1 and set(answers) <= {201, 409}


# ---- cached tokens, counted one way ------------------------------------------------------------------------


def test_usage_summary_and_daily_count_cached_tokens_the_same_way(
    internal_client, client_a, key_a, make_usage_event, usage_started_at
):
    events = [
        make_usage_event(key_a, "req-1", "prefill", tokens=100, cached_tokens=40),
        make_usage_event(key_a, "req-2", "prefill", tokens=50, cached_tokens=0),
        make_usage_event(key_a, "req-1", "decode", tokens=30, cached_tokens=0),
    ]
    assert internal_client.post(INGEST_URL, {"events": events}).status_code == 200
    usage_rollup()
    summary = {row["phase"]: row for row in client_a.get("/api/v1/usage/summary").data["data"]}
    day = usage_started_at.date().isoformat()
    daily = client_a.get("/api/v1/usage/daily", {"start": day, "end": day, "group_by": "phase"}).data
    assert daily["object"] == "list"
    by_phase = {row["key"]: row["tokens"] for row in daily["data"]}
    assert by_phase == {"prefill": 110, "cached_prefill": 40, "decode": 30}
    assert summary["prefill"]["tokens"] == by_phase["prefill"]
    assert summary["prefill"]["cached_tokens"] == by_phase["cached_prefill"]
    assert summary["decode"]["tokens"] == by_phase["decode"]
    assert sum(row["tokens"] + row["cached_tokens"] for row in summary.values()) == sum(by_phase.values())


BATCH_LINE = json.dumps(
    {
        "custom_id": "a",
        "method": "POST",
        "url": "/v1/chat/completions",
        "body": {"model": "diptych-tiny", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4},
    }
)


def signed_in_browser(organization) -> tuple[APIClient, str]:
    """A member's browser as the dashboard has it: a session, CSRF checked, and the token it echoes."""
    _, membership = member_client(organization, "owner")
    browser = APIClient(enforce_csrf_checks=True)
    browser.force_login(membership.user)
    assert browser.get("/api/v1/auth/session").status_code == 200  # sets the csrftoken cookie
    return browser, browser.cookies["csrftoken"].value


def upload_file(client: APIClient, key: str, content: bytes, *, boundary="first-try", purpose_first=False, **headers):
    """POST /api/v1/files as a client library sends it: multipart under `boundary`, the parts in either order."""
    parts = {"file": SimpleUploadedFile("input.jsonl", content), "purpose": "batch"}
    if purpose_first:
        parts = {"purpose": parts["purpose"], "file": parts["file"]}
    return client.post(
        "/api/v1/files",
        encode_multipart(boundary, parts),
        content_type=f"multipart/form-data; boundary={boundary}",
        HTTP_IDEMPOTENCY_KEY=key,
        **headers,
    )


def test_a_browser_upload_with_a_key_is_stored_once_and_replayed(org_a, tiny_model):
    """The CSRF check of a session's POST reads the multipart body before the view: the key still works."""
    browser, csrf = signed_in_browser(org_a)
    content = f"{BATCH_LINE}\n".encode()
    first = upload_file(browser, "upload-1", content, HTTP_X_CSRFTOKEN=csrf)
    retry = upload_file(browser, "upload-1", content, HTTP_X_CSRFTOKEN=csrf)
    assert first.status_code == 200, first.content
    assert retry.status_code == 200 and retry["Idempotent-Replayed"] == "true"
    assert retry.json() == first.json()
    assert File.objects.filter(organization=org_a).count() == 1


@pytest.mark.parametrize("caller", ["api key", "browser"])
def test_the_same_file_under_another_boundary_is_a_replay(org_a, client_a, tiny_model, caller):
    """httpx and requests draw a new multipart boundary on every try: the retry means the same, so it replays."""
    client, headers = client_a, {}
    if caller == "browser":
        client, csrf = signed_in_browser(org_a)
        headers = {"HTTP_X_CSRFTOKEN": csrf}
    content = f"{BATCH_LINE}\n".encode()
    first = upload_file(client, "upload-1", content, boundary="first-try", **headers)
    retry = upload_file(client, "upload-1", content, boundary="second-try", purpose_first=True, **headers)
    assert first.status_code == 200, first.content
    assert retry.status_code == 200, retry.content
    assert retry["Idempotent-Replayed"] == "true" and retry.json() == first.json()
    assert File.objects.filter(organization=org_a).count() == 1


@pytest.mark.parametrize("caller", ["api key", "browser"])
def test_another_file_under_the_same_key_is_refused(org_a, client_a, tiny_model, caller):
    client, headers = client_a, {}
    if caller == "browser":
        client, csrf = signed_in_browser(org_a)
        headers = {"HTTP_X_CSRFTOKEN": csrf}
    assert upload_file(client, "upload-1", f"{BATCH_LINE}\n".encode(), **headers).status_code == 200
    other = upload_file(client, "upload-1", f"{BATCH_LINE}\n{BATCH_LINE}\n".encode(), **headers)
    assert other.status_code == 400, other.content
    assert other.json()["error"]["type"] == "idempotency_key_reused"
    assert File.objects.filter(organization=org_a).count() == 1


def test_a_file_upload_with_one_key_stores_one_file(client_a, org_a, tiny_model):
    request = {"model": "diptych-tiny", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4}
    line = json.dumps({"custom_id": "a", "method": "POST", "url": "/v1/chat/completions", "body": request})

    def upload(key: str, content: bytes):
        body = {"file": SimpleUploadedFile("input.jsonl", content), "purpose": "batch"}
        return client_a.post("/api/v1/files", body, format="multipart", HTTP_IDEMPOTENCY_KEY=key)

    first = upload("upload-1", f"{line}\n".encode())
    retry = upload("upload-1", f"{line}\n".encode())
    assert first.status_code == retry.status_code == 200
    assert retry["Idempotent-Replayed"] == "true" and retry.json()["id"] == first.json()["id"]
    assert File.objects.filter(organization=org_a).count() == 1
    assert upload("upload-1", f"{line}\n{line}\n".encode()).json()["error"]["type"] == "idempotency_key_reused"
