"""Projects: the default project every organization has, project CRUD, project roles, keys issued per project,
usage stamped with its key's project, and the migration that moved today's keys and usage into default projects."""

from datetime import UTC, datetime, timedelta

import pytest
from django.db import connection
from django.db.migrations.executor import MigrationExecutor
from rest_framework.test import APIClient

from controlplane.billing.services import usage_rollup
from controlplane.catalog.services import price_set
from controlplane.metering.models import UsageEvent
from controlplane.tenancy.models import ApiKey, AuditEvent, Organization, Project
from controlplane.tenancy.project_services import project_create, project_member_add, project_update
from controlplane.tenancy.services import api_key_create, member_add, project_default_ensure

PASSWORD = "correct-horse-battery-staple"
INGEST_URL = "/api/v1/internal/usage-events"
VERIFY_URL = "/api/v1/internal/api-keys/verify"
LONG_AGO = datetime(2020, 1, 1, tzinfo=UTC)


def signed_in(organization, role: str, email: str):
    membership = member_add(organization=organization, email=email, role=role, password=PASSWORD)
    client = APIClient()
    client.force_login(membership.user)
    return client, membership


@pytest.fixture
def owner_a(org_a):
    return signed_in(org_a, "owner", "owner@acme.test")


@pytest.fixture
def developer_a(org_a, owner_a):
    return signed_in(org_a, "developer", "dev@acme.test")


def test_a_key_is_issued_in_the_default_project_unless_another_is_named(org_a, key_a):
    default = Project.objects.get(organization=org_a, is_default=True)
    assert key_a.api_key.project == default
    other = project_create(organization=org_a, name="Search")
    issued = api_key_create(organization=org_a, name="search", project=other)
    assert issued.api_key.project == other
    assert project_default_ensure(organization=org_a) == default


def test_project_crud_and_its_audit_events(owner_a):
    client, _ = owner_a
    created = client.post(
        "/api/v1/projects",
        {"name": "Search", "requests_per_minute": 60, "spend_limit_micros": 5_000_000},
        format="json",
    )
    assert created.status_code == 201, created.data
    project_id = created.data["id"]
    assert project_id.startswith("proj_")
    assert created.data["limits"] == {
        "requests_per_minute": 60,
        "input_tokens_per_minute": None,
        "output_tokens_per_minute": None,
    }
    assert (created.data["spend_limit_micros"], created.data["status"]) == (5_000_000, "active")

    listed = client.get("/api/v1/projects")
    assert [p["name"] for p in listed.data["data"]] == ["Default project", "Search"]

    updated = client.patch(
        f"/api/v1/projects/{project_id}", {"name": "Search v2", "input_tokens_per_minute": 1000}, format="json"
    )
    assert updated.status_code == 200, updated.data
    assert (updated.data["name"], updated.data["limits"]["input_tokens_per_minute"]) == ("Search v2", 1000)
    assert client.patch(f"/api/v1/projects/{project_id}", {"colour": "red"}, format="json").status_code == 400

    archived = client.post(f"/api/v1/projects/{project_id}/archive")
    assert (archived.status_code, archived.data["status"]) == (200, "archived")
    assert [p["name"] for p in client.get("/api/v1/projects").data["data"]] == ["Default project"]
    assert len(client.get("/api/v1/projects?include_archived=true").data["data"]) == 2

    actions = {(e.action, e.details.get("project_id")) for e in AuditEvent.objects.filter(target_type="project")}
    assert actions == {("project.create", project_id), ("project.update", project_id), ("project.archive", project_id)}


def test_the_default_project_cannot_be_archived(owner_a, org_a):
    client, _ = owner_a
    default = project_default_ensure(organization=org_a)
    response = client.post(f"/api/v1/projects/{default.public_id}/archive")
    assert response.status_code == 400
    assert response.data["error"]["type"] == "default_project"


def test_a_key_of_an_archived_project_stops_authenticating(org_a, make_bearer_client):
    project = project_create(organization=org_a, name="Old")
    issued = api_key_create(organization=org_a, name="old", project=project, scopes=["admin:read"])
    assert make_bearer_client(issued.key).get("/api/v1/organization").status_code == 200
    project.archived_at = project.created_at
    project.save()
    response = make_bearer_client(issued.key).get("/api/v1/organization")
    assert response.status_code == 401
    assert response.data["error"]["type"] == "api_key_project_archived"


def test_a_member_sees_only_the_default_project_and_their_own(org_a, developer_a):
    client, membership = developer_a
    theirs = project_create(organization=org_a, name="Theirs")
    hidden = project_create(organization=org_a, name="Hidden")
    project_member_add(project=theirs, membership=membership, role="member")
    names = [p["name"] for p in client.get("/api/v1/projects").data["data"]]
    assert names == ["Default project", "Theirs"]
    assert client.get(f"/api/v1/projects/{hidden.public_id}").status_code == 404
    assert client.get(f"/api/v1/projects/{hidden.public_id}/api_keys").status_code == 404
    assert client.post(f"/api/v1/projects/{hidden.public_id}/api_keys", {"name": "k"}, format="json").status_code == 404


def test_project_roles_decide_who_changes_a_project(org_a, owner_a, developer_a):
    client, membership = developer_a
    project = project_create(organization=org_a, name="Search")
    project_member_add(project=project, membership=membership, role="viewer")
    url = f"/api/v1/projects/{project.public_id}"
    assert client.get(url).status_code == 200
    assert client.patch(url, {"name": "mine"}, format="json").status_code == 403
    assert client.post(f"{url}/api_keys", {"name": "k"}, format="json").status_code == 403
    assert client.post("/api/v1/projects", {"name": "new"}, format="json").status_code == 403

    owner_client, _ = owner_a
    [row] = owner_client.get(f"{url}/members").data["data"]
    assert owner_client.patch(f"{url}/members/{row['id']}", {"role": "member"}, format="json").status_code == 200
    created = client.post(f"{url}/api_keys", {"name": "k"}, format="json")
    assert created.status_code == 201, created.data
    assert created.data["project_id"] == project.public_id
    assert client.patch(url, {"name": "mine"}, format="json").status_code == 403

    assert owner_client.patch(f"{url}/members/{row['id']}", {"role": "owner"}, format="json").status_code == 200
    assert client.patch(url, {"name": "mine"}, format="json").status_code == 200
    assert owner_client.delete(f"{url}/members/{row['id']}").status_code == 204
    assert client.get(url).status_code == 404
    member_actions = AuditEvent.objects.filter(target_type="project_member").values_list("action", flat=True)
    assert sorted(member_actions) == [
        "project.member_add",
        "project.member_remove",
        "project.member_set_role",
        "project.member_set_role",
    ]


def test_project_members_come_from_the_organization(org_a, org_b, owner_a):
    client, _ = owner_a
    project = project_create(organization=org_a, name="Search")
    _, stranger = signed_in(org_b, "developer", "dev@bravo.test")
    _, colleague = signed_in(org_a, "developer", "colleague@acme.test")
    url = f"/api/v1/projects/{project.public_id}/members"
    assert client.post(url, {"member_id": stranger.public_id, "role": "member"}, format="json").status_code == 404
    added = client.post(url, {"member_id": colleague.public_id, "role": "member"}, format="json")
    assert (added.status_code, added.data["email"]) == (201, "colleague@acme.test")
    again = client.post(url, {"member_id": colleague.public_id, "role": "viewer"}, format="json")
    assert (again.status_code, again.data["error"]["type"]) == (400, "already_member")


def test_another_organizations_project_is_not_found(org_b, owner_a):
    client, _ = owner_a
    theirs = project_create(organization=org_b, name="Theirs")
    for response in (
        client.get(f"/api/v1/projects/{theirs.public_id}"),
        client.patch(f"/api/v1/projects/{theirs.public_id}", {"name": "x"}, format="json"),
        client.post(f"/api/v1/projects/{theirs.public_id}/archive"),
        client.get(f"/api/v1/projects/{theirs.public_id}/members"),
        client.get(f"/api/v1/projects/{theirs.public_id}/api_keys"),
        client.post("/api/v1/api-keys", {"name": "k", "project_id": theirs.public_id}, format="json"),
    ):
        assert response.status_code == 404, response.data


def test_the_key_create_api_takes_a_project_id(org_a, owner_a):
    client, _ = owner_a
    project = project_create(organization=org_a, name="Search")
    named = client.post("/api/v1/api-keys", {"name": "k", "project_id": project.public_id}, format="json")
    default = client.post("/api/v1/api-keys", {"name": "d"}, format="json")
    assert named.data["project_id"] == project.public_id
    assert default.data["project_id"] == project_default_ensure(organization=org_a).public_id
    listed = client.get(f"/api/v1/projects/{project.public_id}/api_keys").data["data"]
    assert [key["id"] for key in listed] == [named.data["id"]]
    create_event = AuditEvent.objects.get(action="api_key.create", target_id=named.data["id"])
    assert create_event.details["project_id"] == project.public_id


def test_usage_is_stamped_with_its_keys_project(org_a, internal_client, make_usage_event):
    project = project_create(organization=org_a, name="Search")
    issued = api_key_create(organization=org_a, name="search", project=project)
    response = internal_client.post(INGEST_URL, {"events": [make_usage_event(issued)]})
    assert response.data == {"accepted": 1, "duplicates": 0}
    assert UsageEvent.objects.get().project == project


def test_verify_answers_the_projects_limits_and_spend(
    org_a, internal_client, tiny_model, make_usage_event, mid_period_clock
):
    for phase, micros in (("prefill", 1_000_000), ("cached_prefill", 500_000), ("decode", 2_000_000)):
        price_set(model=tiny_model, phase=phase, micros_per_million=micros, effective_from=LONG_AGO)
    project = project_create(
        organization=org_a, name="Search", settings={"requests_per_minute": 7, "spend_limit_micros": 100}
    )
    issued = api_key_create(organization=org_a, name="search", project=project)
    other = api_key_create(organization=org_a, name="elsewhere")
    started = (mid_period_clock - timedelta(minutes=10)).isoformat()
    events = [
        make_usage_event(key, f"req-{n}", started_at=started, finished_at=started)
        for n, key in enumerate([issued, other])
    ]
    internal_client.post(INGEST_URL, {"events": events})
    usage_rollup()
    answer = internal_client.post(VERIFY_URL, {"api_key": issued.key}).data
    assert answer["project_id"] == project.public_id
    assert answer["limits"]["project"]["requests_per_minute"] == 7
    # One event of 120 tokens, 64 of them cached: 56 at $1 and 64 at $0.50 per million, the other key's left out.
    assert answer["project_spend"] == {"limit_micros": 100, "spent_micros": 88, "over_limit": False}
    assert answer["spend"]["spent_micros"] == 176
    project_update(project=project, changes={"spend_limit_micros": 88})
    assert internal_client.post(VERIFY_URL, {"api_key": issued.key}).data["project_spend"]["over_limit"] is True


def test_a_refusal_by_a_projects_limit_is_stored_and_listed_as_the_projects(
    mid_period_clock, client_a, internal_client, key_a
):
    minute = mid_period_clock.replace(second=0, microsecond=0)
    row = {
        "id": "project-refusal-1",
        "organization_id": key_a.api_key.organization.public_id,
        "api_key_id": key_a.api_key.public_id,
        "scope": "project",
        "limit": "requests_per_minute",
        "limit_value": 2,
        "minute": minute.isoformat(),
        "refusals": 3,
    }
    answer = internal_client.post("/api/v1/internal/rate-limit-refusals", {"refusals": [row]}, format="json")
    assert answer.status_code == 200, answer.data
    day = minute.date().isoformat()
    [listed] = client_a.get("/api/v1/rate-limit-refusals", {"start": day, "end": day}).json()["data"]
    assert (listed["scope"], listed["refusals"]) == ("project", 3)


# ---- the migration --------------------------------------------------------------------------------------

BEFORE_PROJECTS = [("tenancy", "0005_apikey_kind"), ("metering", "0007_ratelimitrefusal")]


def _migrate(targets):
    executor = MigrationExecutor(connection)
    executor.loader.build_graph()
    executor.migrate(targets)
    return executor.loader.project_state(targets).apps


@pytest.mark.django_db(transaction=True)
def test_the_migration_moves_every_key_and_every_usage_row_into_its_organizations_default_project():
    latest = MigrationExecutor(connection).loader.graph.leaf_nodes()
    old = _migrate(BEFORE_PROJECTS)
    try:
        OldOrganization = old.get_model("tenancy", "Organization")
        OldApiKey = old.get_model("tenancy", "ApiKey")
        OldUsageEvent = old.get_model("metering", "UsageEvent")
        keys = {}
        for slug in ("acme", "bravo", "empty"):
            organization = OldOrganization.objects.create(name=slug, slug=slug, public_id=f"org_{slug}")
            if slug == "empty":
                continue
            for index in range(3):
                keys[f"key_{slug}{index}"] = OldApiKey.objects.create(
                    organization=organization,
                    public_id=f"key_{slug}{index}",
                    name=f"{slug}{index}",
                    prefix="dip_x",
                    key_hash=f"{slug}{index}".ljust(64, "0"),
                    scopes=["inference"],
                )
        started = "2026-11-18T12:00:00+00:00"
        for number, api_key in enumerate(keys.values()):
            for phase in ("prefill", "decode"):
                OldUsageEvent.objects.create(
                    request_id=f"exec_{number}",
                    phase=phase,
                    organization_id=api_key.organization_id,
                    api_key=api_key,
                    model="diptych-tiny",
                    region="local",
                    worker_id="wrk_1",
                    tokens=10 + number,
                    cached_tokens=number,
                    kv_bytes=0,
                    compute_ms=1,
                    started_at=started,
                    finished_at=started,
                    ingested_at=started,
                    period_start="2026-11-01",
                )
        ledger_before = sorted(OldUsageEvent.objects.values_list("request_id", "phase", "api_key_id", "tokens"))
        keys_before = sorted(OldApiKey.objects.values_list("public_id", "organization_id"))
    finally:
        _migrate(latest)

    assert sorted(ApiKey.objects.values_list("public_id", "organization_id")) == keys_before
    ledger_after = sorted(UsageEvent.objects.values_list("request_id", "phase", "api_key_id", "tokens"))
    assert ledger_after == ledger_before
    for organization in Organization.objects.all():
        [default] = Project.objects.filter(organization=organization)
        assert default.is_default
        assert set(ApiKey.objects.filter(organization=organization).values_list("project_id", flat=True)) <= {
            default.pk
        }
    for event in UsageEvent.objects.select_related("api_key"):
        assert event.project_id == event.api_key.project_id
    assert len(keys_before) == 6 and len(ledger_before) == 12
