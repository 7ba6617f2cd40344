"""Stored responses on the control plane, through the gateway's own client of the internal API (a real server):
a response stored and fetched back whole (token ids included), updated as a background one runs, a cancel that
stays, one organization never reaching another's, deletion, expiry, storage counted per organization, the
input items listed in pages, webhook events of background responses, and bad input refused changing nothing."""

import asyncio
import dataclasses
import struct
from datetime import timedelta

import pytest
from django.utils import timezone

from controlplane.responses.models import StoredResponse
from controlplane.responses.selectors import response_storage
from controlplane.responses.tasks import purge_expired_responses
from controlplane.webhooks import tasks as webhook_tasks
from controlplane.webhooks.models import WebhookEvent
from controlplane.webhooks.services import endpoint_create
from diptych_common.internal_api.client import ControlPlaneClient
from gateway.openai_api.responses_objects import ResponseRecord
from gateway.openai_api.responses_store import ResponseStore, StoreFailed, record_wire
from tests.platform.conftest import INTERNAL_TOKEN

pytestmark = pytest.mark.django_db(transaction=True)

STORE = "/api/v1/internal/responses"


def record(organization_id: str, number: int = 1, **fields) -> ResponseRecord:
    items = [
        {"id": f"msg_{i}", "type": "message", "role": "user", "status": "completed", "content": []} for i in range(3)
    ]
    defaults = {
        "id": f"resp_{number:032x}",
        "organization_id": organization_id,
        "api_key_id": "key_none",
        "model": "diptych-tiny",
        "request": {"instructions": "be brief", "store": True, "background": False},
        "metadata": {"topic": "caches"},
        "context_items": [],
        "input_items": items,
        "prompt_token_ids": [1, 2, 3, 2**32 - 1],
        "status": "completed",
        "output_items": [{"id": "msg_out", "type": "message", "role": "assistant", "content": []}],
        "output_token_ids": [9, 8, 2],
        "usage": {"input_tokens": 4, "output_tokens": 3},
    }
    return ResponseRecord(**{**defaults, **fields})


@pytest.fixture
def loop():
    with asyncio.Runner() as runner:  # one event loop for the test: the client's connections live in it
        yield runner


@pytest.fixture
def store(live_server, loop):
    client = ControlPlaneClient(live_server.url, INTERNAL_TOKEN)
    yield ResponseStore(client)
    loop.run(client.close())


@pytest.fixture
def run(loop):
    return loop.run


def test_a_stored_response_comes_back_whole_with_its_token_ids(store, org_a, key_a, run):
    stored = record(org_a.public_id, api_key_id=key_a.api_key.public_id)
    assert run(store.store(stored)) == "completed"
    fetched = run(store.fetch(org_a.public_id, stored.id))
    assert fetched == stored
    row = StoredResponse.objects.get(public_id=stored.id)
    assert row.api_key == key_a.api_key
    assert bytes(row.prompt_token_ids) == struct.pack("<4I", *stored.prompt_token_ids)  # 4 bytes a token
    assert row.expires_at - row.created_at == timedelta(days=30)


def test_a_queued_response_without_output_is_stored_and_fetched(store, org_a, run):
    """A background response is stored before it produced anything: no output token ids at all."""
    queued = record(org_a.public_id, status="queued", output_items=[], output_token_ids=[], usage=None)
    assert run(store.store(queued)) == "queued"
    fetched = run(store.fetch(org_a.public_id, queued.id))
    assert fetched == dataclasses.replace(queued, api_key_id="")  # a key the organization does not hold: none
    assert bytes(StoredResponse.objects.get().output_token_ids) == b""


def test_another_organizations_response_is_none_of_yours(store, org_a, org_b, run):
    stored = record(org_a.public_id)
    run(store.store(stored))
    assert run(store.fetch(org_b.public_id, stored.id)) is None
    assert run(store.status(org_b.public_id, stored.id)) is None
    assert run(store.delete(org_b.public_id, stored.id)) is False
    assert run(store.cancel(org_b.public_id, stored.id)) is None
    assert run(store.input_items(org_b.public_id, stored.id, {})) is None
    with pytest.raises(StoreFailed):  # nor can another organization overwrite it
        run(store.store(record(org_b.public_id, status="failed")))
    assert run(store.fetch(org_a.public_id, stored.id)).status == "completed"


def test_a_background_response_is_updated_as_it_runs_and_a_cancel_stays(store, org_a, run):
    queued = record(org_a.public_id, status="queued", request={"background": True}, output_items=[], usage=None)
    run(store.store(queued))
    assert run(store.status(org_a.public_id, queued.id)) == "queued"
    cancelled = run(store.cancel(org_a.public_id, queued.id))
    assert cancelled.status == "cancelled"
    # The runner stores what it produced before it saw the cancel: its output is taken, the status stays.
    produced = record(org_a.public_id, status="completed", request={"background": True})
    assert run(store.store(produced, create=False)) == "cancelled"
    fetched = run(store.fetch(org_a.public_id, queued.id))
    assert (fetched.status, fetched.output_token_ids) == ("cancelled", [9, 8, 2])
    assert run(store.cancel(org_a.public_id, queued.id)).status == "cancelled"  # again: as it was


def test_an_ended_response_is_not_cancelled_nor_sent_back_to_running(store, org_a, run):
    ended = record(org_a.public_id, request={"background": True})
    run(store.store(ended))
    with pytest.raises(Exception) as refused:
        run(store.cancel(org_a.public_id, ended.id))
    assert refused.value.response.status_code == 400 and "completed" in refused.value.response.text
    assert run(store.store(record(org_a.public_id, status="in_progress"))) == "completed"
    foreground = record(org_a.public_id, number=2, status="in_progress")
    run(store.store(foreground))
    with pytest.raises(Exception) as refused:
        run(store.cancel(org_a.public_id, foreground.id))
    assert "background" in refused.value.response.text


def test_a_deleted_response_is_gone_and_a_late_update_does_not_bring_it_back(store, org_a, run):
    stored = record(org_a.public_id, status="in_progress", request={"background": True})
    run(store.store(stored))
    assert run(store.delete(org_a.public_id, stored.id)) is True
    assert run(store.fetch(org_a.public_id, stored.id)) is None
    assert run(store.store(record(org_a.public_id), create=False)) is None
    assert not StoredResponse.objects.exists()


def test_expired_responses_are_purged_and_storage_is_counted_per_organization(store, org_a, org_b, run):
    kept, old = record(org_a.public_id, number=1), record(org_a.public_id, number=2)
    other = record(org_b.public_id, number=3)
    for each in (kept, old, other):
        run(store.store(each))
    StoredResponse.objects.filter(public_id=old.id).update(expires_at=timezone.now() - timedelta(seconds=1))
    storage = response_storage(organization=org_a)
    assert storage.responses == 2 and storage.bytes == sum(
        StoredResponse.objects.filter(organization=org_a).values_list("size_bytes", flat=True)
    )
    assert purge_expired_responses() == 1
    assert [r.public_id for r in StoredResponse.objects.filter(organization=org_a)] == [kept.id]
    assert response_storage(organization=org_b).responses == 1


def test_the_size_counts_the_items_and_the_token_ids(store, org_a, run):
    small = record(org_a.public_id, number=1)
    large = record(org_a.public_id, number=2, prompt_token_ids=list(range(1000)))
    run(store.store(small))
    run(store.store(large))
    sizes = dict(StoredResponse.objects.values_list("public_id", "size_bytes"))
    assert sizes[large.id] - sizes[small.id] == 4 * (1000 - 4)


def test_the_storage_figure_is_in_the_public_api(store, client_a, client_b, org_a, run):
    run(store.store(record(org_a.public_id)))
    mine, theirs = client_a.get("/api/v1/responses/storage").data, client_b.get("/api/v1/responses/storage").data
    row = StoredResponse.objects.get()
    assert mine == {"object": "response_storage", "responses": 1, "bytes": row.size_bytes, "retention_days": 30}
    assert theirs["responses"] == 0 and theirs["bytes"] == 0


def test_input_items_come_in_pages_newest_first_or_oldest_first(store, org_a, run):
    stored = record(org_a.public_id)
    run(store.store(stored))
    page = run(store.input_items(org_a.public_id, stored.id, {"limit": "2"}))
    assert [item["id"] for item in page["data"]] == ["msg_2", "msg_1"]
    assert (page["first_id"], page["last_id"], page["has_more"]) == ("msg_2", "msg_1", True)
    rest = run(store.input_items(org_a.public_id, stored.id, {"limit": "2", "after": "msg_1"}))
    assert [item["id"] for item in rest["data"]] == ["msg_0"] and rest["has_more"] is False
    oldest = run(store.input_items(org_a.public_id, stored.id, {"order": "asc"}))
    assert [item["id"] for item in oldest["data"]] == ["msg_0", "msg_1", "msg_2"]
    for bad in ({"limit": "0"}, {"limit": "101"}, {"order": "sideways"}, {"after": "msg_9"}):
        with pytest.raises(Exception) as refused:
            run(store.input_items(org_a.public_id, stored.id, bad))
        assert refused.value.response.status_code == 400, bad


def test_a_background_response_that_ends_is_a_webhook_event_once(store, org_a, run, monkeypatch):
    # The deliveries' tasks are counted, not sent: sent from the live server's thread to the configured broker,
    # they left the Celery app unable to reach the in-memory worker of tests/platform/test_webhooks_delivery.py.
    queued_deliveries: list[int] = []
    monkeypatch.setattr(webhook_tasks.deliver_webhook, "delay", queued_deliveries.append)
    endpoint_create(
        organization=org_a,
        url="https://hooks.example.invalid/x",
        event_types=["response.completed", "response.cancelled", "response.failed"],
    )
    background = {"background": True}
    run(store.store(record(org_a.public_id, number=1, status="queued", request=background)))
    run(store.store(record(org_a.public_id, number=1, status="completed", request=background), create=False))
    run(store.store(record(org_a.public_id, number=1, status="completed", request=background), create=False))
    run(store.store(record(org_a.public_id, number=2, status="in_progress", request=background)))
    run(store.cancel(org_a.public_id, f"resp_{2:032x}"))
    run(store.store(record(org_a.public_id, number=3)))  # not a background one: no event
    events = sorted(WebhookEvent.objects.values_list("type", "subject_id"))
    assert events == [("response.cancelled", f"resp_{2:032x}"), ("response.completed", f"resp_{1:032x}")]
    assert len(queued_deliveries) == 2  # one delivery to the endpoint per event


@pytest.mark.parametrize(
    ("change", "field"),
    [
        ({"id": "resp_../x"}, "id"),
        ({"prompt_token_ids": "not a list"}, "prompt_token_ids"),
        ({"prompt_token_ids": [1, -1]}, "prompt_token_ids"),
        ({"output_token_ids": [2**32]}, "output_token_ids"),
        ({"output_token_ids": [True]}, "output_token_ids"),
        ({"status": "finished"}, "status"),
        ({"input_items": {"not": "a list"}}, "input_items"),
        ({"usage": [1]}, "usage"),
        ({"created_at": "yesterday"}, "created_at"),
        ({"surprise": 1}, "surprise"),
        ({"model": 7}, "model"),
    ],
)
def test_bad_input_is_a_400_naming_the_field_and_stores_nothing(internal_client, org_a, change, field):
    body = {**record_wire(record(org_a.public_id)), **change}
    answer = internal_client.post(STORE, body, format="json")
    assert answer.status_code == 400, answer.content
    assert field in answer.content.decode()
    assert not StoredResponse.objects.exists()


def test_an_unknown_organization_is_a_404(internal_client, db):
    answer = internal_client.post(STORE, record_wire(record("org_nobody")), format="json")
    assert answer.status_code == 404 and not StoredResponse.objects.exists()


def test_an_organizations_key_cannot_reach_the_internal_endpoints(client_a, org_a):
    answer = client_a.post(STORE, record_wire(record(org_a.public_id)), format="json")
    assert answer.status_code in (401, 403) and not StoredResponse.objects.exists()
