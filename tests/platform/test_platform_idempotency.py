"""Idempotency keys as the control plane keeps them for every gateway: one execution per key and
organization, a conflict while it runs, its stored result afterwards, and a free key after a failure."""

from datetime import timedelta

import pytest
from django.utils import timezone

from controlplane.idempotency.models import IdempotencyRecord
from controlplane.idempotency.services import IDEMPOTENCY_KEY_RETENTION, idempotency_records_purge

pytestmark = pytest.mark.django_db

CLAIM = "/api/v1/internal/idempotency-keys/claim"
COMPLETE = "/api/v1/internal/idempotency-keys/complete"
RELEASE = "/api/v1/internal/idempotency-keys/release"
FIRST = "exec_" + "1" * 32
SECOND = "exec_" + "2" * 32


def claim(client, organization, execution_id=FIRST, key="k-1", fingerprint="f-1", lease_seconds=60, caller="key_1"):
    response = client.post(
        CLAIM,
        {
            "organization_id": organization.public_id,
            "key": key,
            "caller": caller,
            "fingerprint": fingerprint,
            "execution_id": execution_id,
            "lease_seconds": lease_seconds,
        },
        format="json",
    )
    assert response.status_code == 200, response.data
    return response.data


def settle(client, path, organization, execution_id=FIRST, key="k-1", **extra):
    body = {"organization_id": organization.public_id, "key": key, "execution_id": execution_id, **extra}
    response = client.post(path, body, format="json")
    assert response.status_code == 200, response.data
    return response.data


def test_the_first_request_claims_the_key_and_another_meets_a_conflict_while_it_runs(internal_client, org_a):
    assert claim(internal_client, org_a)["outcome"] == "claimed"
    assert claim(internal_client, org_a, SECOND) == {"outcome": "in_flight", "execution_id": FIRST, "response": None}


def test_a_completed_key_answers_with_the_stored_response(internal_client, org_a):
    claim(internal_client, org_a)
    stored = {"requestId": FIRST, "text": "hello", "tokenIds": [1, 2]}
    assert settle(internal_client, COMPLETE, org_a, response=stored) == {"stored": True}
    assert claim(internal_client, org_a, SECOND) == {"outcome": "completed", "execution_id": FIRST, "response": stored}


def test_another_caller_gets_neither_the_stored_response_nor_news_of_the_execution(internal_client, org_a):
    claim(internal_client, org_a)
    assert claim(internal_client, org_a, SECOND, caller="key_2") == {
        "outcome": "other_caller",
        "execution_id": "",
        "response": None,
    }
    settle(internal_client, COMPLETE, org_a, response={"requestId": FIRST, "text": "private"})
    assert claim(internal_client, org_a, SECOND, caller="key_2")["outcome"] == "other_caller"
    assert claim(internal_client, org_a, SECOND, caller="key_2", fingerprint="f-2")["outcome"] == "other_caller"
    assert claim(internal_client, org_a, SECOND)["outcome"] == "completed"


def test_a_key_used_with_other_parameters_is_a_mismatch(internal_client, org_a):
    claim(internal_client, org_a)
    assert claim(internal_client, org_a, SECOND, fingerprint="f-2")["outcome"] == "mismatch"


def test_keys_are_scoped_to_their_organization(internal_client, org_a, org_b):
    claim(internal_client, org_a)
    assert claim(internal_client, org_b, SECOND)["outcome"] == "claimed"


def test_a_released_key_is_free_for_a_new_execution(internal_client, org_a):
    claim(internal_client, org_a)
    assert settle(internal_client, RELEASE, org_a) == {"released": True}
    assert claim(internal_client, org_a, SECOND)["outcome"] == "claimed"


def test_only_the_execution_holding_the_key_can_complete_or_release_it(internal_client, org_a):
    claim(internal_client, org_a)
    assert settle(internal_client, RELEASE, org_a, SECOND) == {"released": False}
    assert settle(internal_client, COMPLETE, org_a, SECOND, response={}) == {"stored": False}
    assert claim(internal_client, org_a, SECOND)["outcome"] == "in_flight"


def test_a_key_whose_lease_ended_goes_to_the_next_execution(internal_client, org_a):
    claim(internal_client, org_a, lease_seconds=1)
    IdempotencyRecord.objects.update(lease_expires_at=timezone.now() - timedelta(seconds=1))
    assert claim(internal_client, org_a, SECOND)["outcome"] == "claimed"
    assert settle(internal_client, COMPLETE, org_a, FIRST, response={}) == {"stored": False}


def test_records_older_than_the_retention_are_purged_and_their_keys_free(internal_client, org_a):
    claim(internal_client, org_a)
    settle(internal_client, COMPLETE, org_a, response={"text": "old"})
    later = timezone.now() + IDEMPOTENCY_KEY_RETENTION + timedelta(minutes=1)
    assert idempotency_records_purge(now=later) == 1
    assert claim(internal_client, org_a, SECOND)["outcome"] == "claimed"


@pytest.mark.parametrize(
    "field, value",
    [
        ("organization_id", "org_unknown"),
        ("execution_id", "client-chosen"),
        ("lease_seconds", 0),
        ("key", ""),
        ("caller", ""),
    ],
)
def test_bad_claims_are_refused_and_store_nothing(internal_client, org_a, field, value):
    body = {
        "organization_id": org_a.public_id,
        "key": "k",
        "caller": "key_1",
        "fingerprint": "f",
        "execution_id": FIRST,
        "lease_seconds": 60,
        field: value,
    }
    response = internal_client.post(CLAIM, body, format="json")
    assert response.status_code == 400
    assert IdempotencyRecord.objects.count() == 0


def test_only_the_gateway_may_claim(client_a, org_a):
    response = client_a.post(CLAIM, {"organization_id": org_a.public_id}, format="json")
    assert response.status_code in (401, 403)


def test_a_response_holding_any_character_is_stored_and_replayed_whole(internal_client, org_a):
    """Generated text can hold NUL and other control characters, which PostgreSQL's jsonb refuses: the
    response must still be stored, or the key would stay in flight and a retry run (and bill) again."""
    claim(internal_client, org_a)
    stored = {"requestId": FIRST, "text": "a\x00b\x01c\ud7ff\U0010ffff", "tokenIds": [0, 1]}
    assert settle(internal_client, COMPLETE, org_a, response=stored) == {"stored": True}
    assert claim(internal_client, org_a, SECOND)["response"] == stored
