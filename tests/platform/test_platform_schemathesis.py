"""Property-based conformance of the whole API to its own OpenAPI schema (schemathesis, bounded).

Every check runs but positive_data_acceptance: some schema-valid requests are refused on purpose by rules
an OpenAPI schema cannot state (an unknown organization in a usage event, a password that is too common,
kv_blocks_free above kv_blocks_total, an expiry in the past, a missing Stripe signature, end before start).
Those refusals are tested one by one in the other files.
"""

import os

import pytest
import schemathesis
from django.core import signals
from django.core.wsgi import get_wsgi_application
from django.db import close_old_connections
from hypothesis import HealthCheck, settings

from controlplane.common.openapi import full_schema
from controlplane.tenancy.services import member_add

# Bounded for CI; raise it for a deeper one-off search.
MAX_EXAMPLES = int(os.environ.get("DIPTYCH_SCHEMATHESIS_EXAMPLES", "8"))


# The schema of every endpoint, the internal ones (left out of the public schema) included. Building it
# touches no database, so it loads at collection; each operation is one test.
schema = schemathesis.openapi.from_dict(full_schema())
schema.app = get_wsgi_application()


@pytest.fixture
def keep_the_test_transaction():
    """Calls go straight to the WSGI app, not through Django's test client, which is what normally stops
    Django from closing the connection (and the test's transaction) when each request ends."""
    signals.request_started.disconnect(close_old_connections)
    signals.request_finished.disconnect(close_old_connections)
    yield
    signals.request_started.connect(close_old_connections)
    signals.request_finished.connect(close_old_connections)


@pytest.fixture
def credentials(keep_the_test_transaction, key_a, prefill_fleet, org_a, tiny_model) -> dict[str, str]:
    member_add(organization=org_a, email="schema-owner@acme.test", role="owner", password="schema-owner-pass-1")
    return {"tenant": key_a.key, "fleet": prefill_fleet.token}


FLEET_TOKEN_PATHS = (
    "/api/v1/internal/workers/",
    "/api/v1/internal/artifacts/manifest",
    "/api/v1/internal/artifacts/files/",
)


def _authorization(path: str, credentials: dict[str, str], internal_token: str) -> str:
    if path.startswith(FLEET_TOKEN_PATHS):
        return f"Bearer {credentials['fleet']}"
    if path.startswith("/api/v1/internal/"):
        return f"Bearer {internal_token}"
    return f"Bearer {credentials['tenant']}"


@schema.parametrize()
@settings(
    max_examples=MAX_EXAMPLES, deadline=None, derandomize=True, database=None, suppress_health_check=list(HealthCheck)
)
def test_api_conforms_to_its_schema(case, db, credentials, internal_token):
    case.call_and_validate(
        headers={"Authorization": _authorization(case.path, credentials, internal_token)},
        excluded_checks=[schemathesis.checks.positive_data_acceptance],
    )
