"""Webhook deliveries to a real HTTP receiver on loopback (webhook_receiver.py), which verifies every try
with the official openai client: tries made by a real Celery worker (in a thread, on an in-memory broker)
with backoff on a short schedule, the same `webhook-id` and body on every try, each try recorded; the
secret's overlap after a rotation; the test event; the refusal at send time of a destination the operator
no longer allows; and batches that end emitting their event.

The receiver is on loopback and speaks plain HTTP, which the operator's settings allow here, as
DIPTYCH_WEBHOOKS_ALLOW_PRIVATE=1 and DIPTYCH_WEBHOOKS_ALLOW_HTTP=1 would.
"""

import itertools
import threading
import time
from datetime import timedelta

import pytest
from celery.contrib.testing.worker import start_worker
from celery.signals import task_postrun
from django.conf import settings
from django.db import connection
from django.utils import timezone

from controlplane.batches.models import Batch, BatchLine
from controlplane.batches.run_services import LineAnswer, line_answered
from controlplane.batches.runner import run_slice
from controlplane.catalog.models import Model
from controlplane.celery import app as celery_app
from controlplane.webhooks.delivery import try_delivery
from controlplane.webhooks.models import WebhookDelivery, WebhookEndpoint, WebhookEvent
from controlplane.webhooks.services import emit_event
from controlplane.webhooks.tasks import resume_webhook_deliveries
from tests.platform.test_platform_batches import create_batch, jsonl, line, upload
from tests.platform.webhook_receiver import Receiver

WEBHOOKS = "/api/v1/webhooks"
FIRST_RETRY_S = 0.3


@pytest.fixture(autouse=True)
def loopback_receivers_allowed(settings) -> None:
    settings.DIPTYCH_WEBHOOKS_ALLOWED_NETWORKS = ["127.0.0.0/8"]
    settings.DIPTYCH_WEBHOOKS_ALLOW_HTTP = True
    settings.DIPTYCH_WEBHOOK_FIRST_RETRY_SECONDS = FIRST_RETRY_S
    settings.DIPTYCH_WEBHOOK_TIMEOUT_SECONDS = 5


@pytest.fixture
def receiver():
    with Receiver() as receiver:
        yield receiver


def subscribe(client, receiver: Receiver, event_types=("batch.completed",)) -> dict:
    response = client.post(WEBHOOKS, {"url": receiver.url, "event_types": list(event_types)}, format="json")
    assert response.status_code == 201, response.data
    receiver.secrets = [response.data["signing_secret"]]
    return response.data


class FinishedTasks:
    """Counts the worker's finished tasks, so that the test reads the database only once the worker is done
    with it (SQLite's in-memory test database refuses a second connection's access, it does not wait)."""

    def __init__(self) -> None:
        self._count = 0
        self._changed = threading.Condition()

    def finished(self, **kwargs) -> None:
        connection.close()  # the worker thread's own; else it outlives the test's database
        with self._changed:
            self._count += 1
            self._changed.notify_all()

    def wait_for(self, count: int, seconds: float = 30.0) -> None:
        with self._changed:
            assert self._changed.wait_for(lambda: self._count >= count, seconds), f"{self._count} tasks, not {count}"


@pytest.fixture
def celery_worker(transactional_db):
    """A Celery worker of the control plane's app in a thread, on an in-memory broker of its own."""
    overridden = ("broker_url", "broker_transport", "broker_transport_options")
    saved = {name: celery_app.conf[name] for name in overridden}
    celery_app.close()  # drops a connection pool made for the configured broker
    celery_app.conf.update(
        broker_url="memory://", broker_transport="memory", broker_transport_options={"polling_interval": 0.01}
    )
    tasks = FinishedTasks()
    task_postrun.connect(tasks.finished)
    try:
        with start_worker(celery_app, pool="solo", perform_ping_check=False, shutdown_timeout=10):
            yield tasks
    finally:
        task_postrun.disconnect(tasks.finished)
        celery_app.close()
        celery_app.conf.update(saved)


def test_a_delivery_failing_twice_succeeds_on_its_third_try_and_reaches_the_application_once(
    celery_worker, client_a, org_a, receiver
):
    receiver.statuses = [500, 503]  # the receiver handles each try, but answers the first two with errors
    endpoint = subscribe(client_a, receiver)
    event = emit_event(organization=org_a, event_type="batch.completed", data={"id": "batch_abc"})
    tries = receiver.wait_for_tries(3)
    celery_worker.wait_for(3)
    delivery = WebhookDelivery.objects.get(event=event)
    assert delivery.status == "delivered"
    assert [attempt.status for attempt in tries] == [500, 503, 200]
    assert {attempt.headers["webhook-id"] for attempt in tries} == {event.public_id}
    assert len({attempt.body for attempt in tries}) == 1
    assert all(attempt.verified_by == receiver.secrets for attempt in tries)  # each try signed, and verified
    (handed_on,) = receiver.application  # deduplicated by webhook-id
    assert handed_on.type == "batch.completed" and handed_on.id == event.public_id
    assert handed_on.data.id == "batch_abc" and handed_on.object == "event"
    gaps = [later.received_at - earlier.received_at for earlier, later in itertools.pairwise(tries)]
    assert gaps[0] >= FIRST_RETRY_S and gaps[1] >= 3 * FIRST_RETRY_S  # the backoff, never shorter

    assert delivery.attempts == 3 and delivery.next_attempt_at is None and delivery.delivered_at is not None
    listed = client_a.get(f"{WEBHOOKS}/{endpoint['id']}/deliveries").data
    (shown,) = listed["data"]
    assert shown["id"] == delivery.public_id and shown["status"] == "delivered"
    assert shown["event_id"] == event.public_id and shown["event_type"] == "batch.completed"
    assert [(a["number"], a["status_code"]) for a in shown["attempts"]] == [(1, 500), (2, 503), (3, 200)]
    assert shown["attempts"][0]["error"] == "HTTP 500: not now" and shown["attempts"][2]["error"] == ""
    assert all(a["duration_ms"] >= 0 for a in shown["attempts"])
    time.sleep(3 * FIRST_RETRY_S)
    assert len(receiver.tries) == 3  # nothing after the success


def test_a_delivery_that_never_succeeds_fails_after_its_last_try(celery_worker, client_a, org_a, receiver, settings):
    settings.DIPTYCH_WEBHOOK_MAX_TRIES = 3
    receiver.statuses = [500] * 10
    subscribe(client_a, receiver, ["batch.expired"])
    event = emit_event(organization=org_a, event_type="batch.expired", data={"id": "batch_x"})
    receiver.wait_for_tries(3)
    celery_worker.wait_for(3)
    delivery = WebhookDelivery.objects.get(event=event)
    assert delivery.status == "failed" and delivery.attempts == 3 and delivery.next_attempt_at is None
    time.sleep(9 * FIRST_RETRY_S)  # longer than a fourth try's backoff
    assert len(receiver.tries) == 3


def stored_delivery(endpoint: WebhookEndpoint, subject: str, **fields) -> WebhookDelivery:
    """A delivery stored as emit_event stores it, but whose task was never sent."""
    event = WebhookEvent.objects.create(
        organization=endpoint.organization, type="batch.completed", subject_id=subject, data={"id": subject}
    )
    return WebhookDelivery.objects.create(event=event, endpoint=endpoint, **fields)


def test_a_delivery_whose_task_was_lost_is_resumed_by_the_beat_task(celery_worker, client_a, receiver):
    """Its event committed but no task reached a worker (a broker down then, a worker restarted since): once
    overdue by a resume interval it is tried; one a try still holds is left to that try."""
    endpoint = WebhookEndpoint.objects.get(public_id=subscribe(client_a, receiver)["id"])
    overdue = timezone.now() - timedelta(seconds=2 * settings.DIPTYCH_WEBHOOK_RESUME_SECONDS)
    lost = stored_delivery(endpoint, "batch_lost", next_attempt_at=overdue)
    held = stored_delivery(
        endpoint, "batch_held", next_attempt_at=overdue, lease_until=timezone.now() + timedelta(minutes=1)
    )
    assert resume_webhook_deliveries() == 1
    receiver.wait_for_tries(1)
    celery_worker.wait_for(1)
    (handed_on,) = receiver.application
    assert handed_on.data.id == "batch_lost"
    assert WebhookDelivery.objects.get(id=lost.id).status == "delivered"
    assert WebhookDelivery.objects.get(id=held.id).attempts == 0


def test_a_try_that_gets_no_answer_records_the_error_and_is_retried(client_a, org_a, receiver):
    endpoint = subscribe(client_a, receiver)
    WebhookEndpoint.objects.filter(public_id=endpoint["id"]).update(url="http://127.0.0.1:9/closed")
    event = emit_event(organization=org_a, event_type="batch.completed", data={"id": "batch_1"})
    delivery = try_delivery(WebhookDelivery.objects.get(event=event).id)
    assert delivery is not None and delivery.status == "pending" and delivery.attempts == 1
    (attempt,) = delivery.attempt_log.all()
    assert attempt.status_code is None and attempt.error.startswith("ConnectError")
    assert delivery.next_attempt_at - attempt.started_at >= timedelta(seconds=FIRST_RETRY_S)
    assert try_delivery(delivery.id) is None  # not due before its backoff ends


def test_a_destination_no_longer_allowed_is_refused_at_send_time(client_a, org_a, receiver, settings):
    subscribe(client_a, receiver)
    settings.DIPTYCH_WEBHOOKS_ALLOWED_NETWORKS = []  # the operator took the allowance back
    event = emit_event(organization=org_a, event_type="batch.completed", data={"id": "batch_1"})
    delivery = try_delivery(WebhookDelivery.objects.get(event=event).id)
    assert delivery is not None and delivery.status == "failed" and delivery.attempts == 1  # no retry
    (attempt,) = delivery.attempt_log.all()
    assert attempt.status_code is None
    assert attempt.error.startswith("Refused: 127.0.0.1 is a loopback address")
    assert receiver.tries == []


def test_the_test_event_is_sent_once_now_and_listed(client_a, receiver):
    endpoint = subscribe(client_a, receiver, ["response.completed"])
    url = f"{WEBHOOKS}/{endpoint['id']}/test"
    result = client_a.post(url, {"event_type": "response.completed"}, format="json")
    assert result.status_code == 200, result.data
    assert result.data["object"] == "webhook_endpoint.test" and result.data["success"] is True
    assert result.data["status_code"] == 200 and result.data["webhook_endpoint_id"] == endpoint["id"]
    (handed_on,) = receiver.application
    assert handed_on.type == "response.completed" and handed_on.data.id.startswith("resp_")
    receiver.statuses = [500]
    failed = client_a.post(url, {}, format="json").data
    assert failed["success"] is False and failed["status_code"] == 500 and failed["event_type"] == "batch.completed"
    assert failed["delivery"]["status"] == "failed" and len(failed["delivery"]["attempts"]) == 1  # no retries
    listed = client_a.get(f"{WEBHOOKS}/{endpoint['id']}/deliveries").data["data"]
    assert [d["status"] for d in listed] == ["failed", "delivered"]


def test_after_a_rotation_both_secrets_verify_until_the_overlap_ends(client_a, receiver):
    endpoint = subscribe(client_a, receiver)
    old_secret = endpoint["signing_secret"]
    rotate = f"{WEBHOOKS}/{endpoint['id']}/rotate-secret"
    new_secret = client_a.post(rotate, {}, format="json").data["signing_secret"]
    receiver.secrets = [new_secret, old_secret]
    send_test = f"{WEBHOOKS}/{endpoint['id']}/test"
    assert client_a.post(send_test, {}, format="json").data["success"]
    overlap = receiver.tries[-1]
    assert overlap.verified_by == [new_secret, old_secret]
    assert len(overlap.headers["webhook-signature"].split(" ")) == 2

    # The overlap's 24 hours pass: the old secret signs no more.
    WebhookEndpoint.objects.filter(public_id=endpoint["id"]).update(
        previous_secret_until=timezone.now() - timedelta(seconds=1)
    )
    assert client_a.post(send_test, {}, format="json").data["success"]
    assert receiver.tries[-1].verified_by == [new_secret]

    newest = client_a.post(rotate, {"keep_old_secret_active_for_24_hours": False}, format="json").data
    receiver.secrets = [newest["signing_secret"], new_secret]
    assert client_a.post(send_test, {}, format="json").data["success"]
    assert receiver.tries[-1].verified_by == [newest["signing_secret"]]
    assert len(receiver.application) == 3


@pytest.fixture
def batch(client_a, tiny_model) -> Batch:
    uploaded = upload(client_a, jsonl(line("a"), line("b")))
    assert uploaded.status_code == 200, uploaded.data
    created = create_batch(client_a, uploaded.data["id"])
    assert created.status_code == 200, created.data
    return Batch.objects.get(public_id=created.data["id"])


def _complete(batch: Batch) -> None:
    for batch_line in BatchLine.objects.filter(batch=batch):
        answer = {"id": f"exec_{batch_line.custom_id}", "choices": [], "usage": {}}
        line_answered(line=batch_line, answer=LineAnswer(status_code=200, body=answer, request_id="exec"))


def _cancel(batch: Batch) -> None:
    Batch.objects.filter(id=batch.id).update(status="cancelling", cancelling_at=timezone.now())


def _expire(batch: Batch) -> None:
    Batch.objects.filter(id=batch.id).update(expires_at=timezone.now() - timedelta(seconds=1))


@pytest.mark.parametrize(
    ("end", "event_type"),
    [(_complete, "batch.completed"), (_cancel, "batch.cancelled"), (_expire, "batch.expired")],
)
def test_a_batch_that_ends_emits_its_event_once_its_end_commits(
    client_a, receiver, batch, end, event_type, django_capture_on_commit_callbacks
):
    subscribe(client_a, receiver, ["batch.completed", "batch.cancelled", "batch.expired"])
    end(batch)
    with django_capture_on_commit_callbacks() as sent_on_commit:
        assert run_slice(batch.id).ended
    assert len(sent_on_commit) == 1  # the first try's task, sent once the end commits
    delivery = WebhookDelivery.objects.select_related("event").get()
    assert delivery.event.type == event_type and delivery.event.data == {"id": batch.public_id}
    try_delivery(delivery.id)  # what the task does
    (handed_on,) = receiver.application
    assert handed_on.type == event_type and handed_on.data.id == batch.public_id
    batch.refresh_from_db()
    assert handed_on.created_at >= int(batch.created_at.timestamp())


def test_a_batch_whose_model_left_the_catalog_before_it_ran_fails_and_delivers_one_batch_failed_event(
    client_a, receiver, batch, tiny_model, django_capture_on_commit_callbacks
):
    subscribe(client_a, receiver, ["batch.completed", "batch.failed"])
    Model.objects.filter(id=tiny_model.id).update(name="diptych-tiny-retired")  # after the create checked it
    with django_capture_on_commit_callbacks() as sent_on_commit:
        assert run_slice(batch.id).ended
    assert len(sent_on_commit) == 1
    delivery = WebhookDelivery.objects.select_related("event").get()
    assert delivery.event.type == "batch.failed" and delivery.event.data == {"id": batch.public_id}
    try_delivery(delivery.id)
    (handed_on,) = receiver.application
    assert handed_on.type == "batch.failed" and handed_on.data.id == batch.public_id

    shown = client_a.get(f"/api/v1/batches/{batch.public_id}").data
    assert shown["status"] == "failed" and shown["failed_at"] is not None and shown["in_progress_at"] is None
    assert [(error["line"], error["code"]) for error in shown["errors"]["data"]] == [
        (1, "invalid_model"),
        (2, "invalid_model"),
    ]
    assert "'diptych-tiny' is not in the catalog" in shown["errors"]["data"][0]["message"]
    assert shown["output_file_id"] is None and shown["error_file_id"] is None
    assert set(BatchLine.objects.filter(batch=batch).values_list("state", flat=True)) == {"not_run"}
    batch.refresh_from_db()
    assert batch.runner_key.revoked_at is not None

    assert run_slice(batch.id).ended is False  # ended once: a later runner finds nothing to do
    assert WebhookEvent.objects.filter(type="batch.failed").count() == 1
