"""Property-based conformance of the whole API to its own OpenAPI schema (schemathesis, bounded).

Every operation of the schema (the internal ones, left out of the public schema, included) is one test:
each response must match what the schema documents for it (status, content type, headers, body), and a
request the schema calls valid must not be refused as malformed. The organization calling owns one object
of every kind (a file, batches in several states, usage, an invoice, an invitation, a member, a worker, a
published model revision), and half the generated cases name those objects in their path, so that real
objects' answers are checked, not only 404s.

positive_data_acceptance is left out for the operations below only: they refuse some schema-valid requests
on purpose, by rules an OpenAPI schema cannot state. Each refusal is tested one by one in the other files.
"""

import json
import os
import uuid
from datetime import timedelta

import pytest
import schemathesis
from django.core import signals
from django.core.wsgi import get_wsgi_application
from django.db import close_old_connections
from django.test import Client
from django.utils import timezone
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st

from controlplane.batches.services import batch_cancel, batch_create, file_upload
from controlplane.billing.services import billing_periods_close, usage_rollup
from controlplane.catalog.services import model_publish, price_set, publication_prepare, worker_register
from controlplane.common.idempotency import HEADER as IDEMPOTENCY_HEADER
from controlplane.common.openapi import full_schema
from controlplane.tenancy.services import member_add, member_invite, user_ensure
from tests.platform.conftest import usage_event
from tests.platform.test_platform_artifacts import write_model_directory
from tests.platform.test_platform_billing import LONG_AGO, TINY_PRICES, ingest, last_month_at

# Bounded for CI; raise it for a deeper one-off search.
MAX_EXAMPLES = int(os.environ.get("DIPTYCH_SCHEMATHESIS_EXAMPLES", "8"))

# Refusals of schema-valid requests by rules no OpenAPI schema states.
REFUSE_SOME_VALID_REQUESTS = {
    "POST /api/v1/internal/usage-events",  # an unknown organization or key in an event
    "POST /api/v1/internal/rate-limit-refusals",  # the same, in a refusal
    "POST /api/v1/auth/accept-invitation",  # a password that is too common
    "POST /api/v1/internal/workers/{worker_id}/heartbeat",  # kv_blocks_free above kv_blocks_total
    "POST /api/v1/internal/workers/register",  # a revision of the model that was never published
    "POST /api/v1/internal/models/register",  # paths that do not name the files one to one, or leave the folder
    "POST /api/v1/api-keys",  # an expiry in the past
    "POST /api/v1/files",  # a file that is not JSON Lines of requests to a served model
    "POST /api/v1/stripe/webhook",  # a missing or wrong Stripe signature
    "POST /api/v1/webhooks",  # a URL whose host resolves to a loopback, private or other non-public address
    "POST /api/v1/internal/webhooks/events",  # an unknown organization
    "GET /api/v1/usage-events",  # end before start
    "GET /api/v1/usage/daily",  # end before start, or more than 366 days after it (documented in words)
    "GET /api/v1/usage/requests",  # the same
    "GET /api/v1/rate-limit-refusals",  # the same
    "GET /api/v1/usage/request-log",  # the same
    "GET /api/v1/usage/latency",  # the same
    "POST /api/v1/projects/{project_id}/api_keys",  # an expiry in the past
    "POST /api/v1/projects/{project_id}/archive",  # the default project
    "GET /api/v1/organization/usage/completions",  # end_time before start_time, a page of another query
    "GET /api/v1/organization/costs",  # the same
    # an unknown organization (the gateway names only organizations whose keys it verified)
    "POST /api/v1/internal/idempotency-keys/claim",
    "POST /api/v1/internal/idempotency-keys/complete",
    "POST /api/v1/internal/idempotency-keys/release",
}

# The schema of every endpoint, the internal ones included. Building it touches no database, so it loads at
# collection; each operation is one test.
schema = schemathesis.openapi.from_dict(full_schema())
schema.app = get_wsgi_application()

# Path parameter name -> the id of an object the calling organization owns; filled by `seeded` for each test.
SEEDED: dict[str, str] = {}


@schema.hook
def flatmap_path_parameters(context, path_parameters):
    """The generated parameters, or the same with every parameter that names a seeded object set to it."""
    if not path_parameters:
        return st.just(path_parameters)
    known = {name: SEEDED[name] for name in path_parameters if name in SEEDED}
    return st.sampled_from([path_parameters, {**path_parameters, **known}])


def _batches(organization) -> dict[str, str]:
    lines = [
        {"custom_id": f"r{i}", "method": "POST", "url": "/v1/chat/completions", "body": {"model": "diptych-tiny"}}
        for i in range(2)
    ]
    content = b"".join(json.dumps(line).encode() + b"\n" for line in lines)
    file = file_upload(organization=organization, filename="input.jsonl", content=content, purpose="batch")
    create = {"organization": organization, "input_file_id": file.public_id, "endpoint": "/v1/chat/completions"}
    batch_cancel(batch=batch_create(**create, completion_window="24h", metadata={"kind": "cancelled"}))
    batch = batch_create(**create, completion_window="24h")
    return {"file_id": file.public_id, "batch_id": batch.public_id}


def _usage_and_invoice(issued_key, internal_client, tiny_model) -> str:
    for phase, micros in TINY_PRICES.items():
        price_set(model=tiny_model, phase=phase, micros_per_million=micros, effective_from=LONG_AGO)
    for started_at in (last_month_at(3), timezone.now() - timedelta(hours=1)):
        for phase in ("prefill", "decode"):
            ingest(internal_client, usage_event, issued_key, f"req-{started_at:%m%d}", phase, started_at)
    usage_rollup(full=True)
    return billing_periods_close()[0].public_id


def _published_model(tiny_model, directory, settings) -> dict[str, str]:
    settings.DIPTYCH_ARTIFACT_DIR = directory / "store"
    model_directory = write_model_directory(directory / "model")
    publication = publication_prepare(model_name=tiny_model.name, directory=model_directory, revision="r1")
    model_publish(model=tiny_model, publication=publication)
    return {"model": tiny_model.name, "name": tiny_model.name, "revision": "r1", "path": "config.json"}


@pytest.fixture
def seeded(key_a, org_a, prefill_fleet, tiny_model, internal_client, tmp_path, settings):
    """The credentials of each kind of caller, and one object of every kind in `SEEDED`."""
    owner = member_add(organization=org_a, email="schema-owner@acme.test", role="owner", password="schema-pass-1")
    invitation = member_invite(organization=org_a, email="invited@acme.test", role="developer").invitation
    worker = worker_register(fleet=prefill_fleet.fleet, name="prefill-0", address="127.0.0.1:50061")
    SEEDED.update(
        key_id=key_a.api_key.public_id,
        member_id=owner.public_id,
        invitation_id=invitation.public_id,
        worker_id=worker.public_id,
        invoice_id=_usage_and_invoice(key_a, internal_client, tiny_model),
        request_id=f"req-{last_month_at(3):%m%d}",  # a request of _usage_and_invoice's
        **_batches(org_a),
        **_published_model(tiny_model, tmp_path, settings),
    )
    staff = Client()
    staff.force_login(user_ensure(email="staff@diptych.test", password="staff-pass-1", is_staff=True))
    yield {"tenant": key_a.key, "fleet": prefill_fleet.token, "staff": staff.cookies["sessionid"].value}
    SEEDED.clear()


STAFF_PATHS = ("/api/v1/fleets", "/api/v1/workers")


@pytest.fixture
def credentials(seeded):
    """Calls go straight to the WSGI app, not through Django's test client, which is what normally stops
    Django from closing the connection (and the test's transaction) when each request ends. (After the
    seeding, whose test client calls connect it again.)"""
    signals.request_started.disconnect(close_old_connections)
    signals.request_finished.disconnect(close_old_connections)
    yield seeded
    signals.request_started.connect(close_old_connections)
    signals.request_finished.connect(close_old_connections)


FLEET_TOKEN_PATHS = (
    "/api/v1/internal/workers/",
    "/api/v1/internal/artifacts/manifest",
    "/api/v1/internal/artifacts/files/",
)


def _credentials(path: str, credentials: dict[str, str], internal_token: str) -> dict[str, str]:
    if path.startswith(STAFF_PATHS):
        return {"Cookie": f"sessionid={credentials['staff']}"}
    if path.startswith(FLEET_TOKEN_PATHS):
        return {"Authorization": f"Bearer {credentials['fleet']}"}
    if path.startswith("/api/v1/internal/"):
        return {"Authorization": f"Bearer {internal_token}"}
    return {"Authorization": f"Bearer {credentials['tenant']}"}


@schema.parametrize()
@settings(
    max_examples=MAX_EXAMPLES, deadline=None, derandomize=True, database=None, suppress_health_check=list(HealthCheck)
)
def test_api_conforms_to_its_schema(case, db, credentials, internal_token):
    refuses_some = f"{case.method.upper()} {case.path}" in REFUSE_SOME_VALID_REQUESTS
    if case.headers and IDEMPOTENCY_HEADER in case.headers:
        # A fresh key for every case: one key sent again with another request is refused (400) by a rule
        # that spans requests, which no schema states.
        case.headers[IDEMPOTENCY_HEADER] = uuid.uuid4().hex
    case.call_and_validate(
        headers=_credentials(case.path, credentials, internal_token),
        excluded_checks=[schemathesis.checks.positive_data_acceptance] if refuses_some else [],
    )
