"""Staff drain a worker: the registry and the worker's next heartbeats say draining until it leaves."""

from datetime import timedelta

from django.utils import timezone

from controlplane.catalog.models import Worker
from controlplane.tenancy.models import AuditEvent

REGISTER_URL = "/api/v1/internal/workers/register"
REGISTRY_URL = "/api/v1/internal/registry"


def drain_url(worker_id: str) -> str:
    return f"/api/v1/workers/{worker_id}/drain"


def heartbeat(client, worker_id: str, state: str = "ready"):
    return client.post(f"/api/v1/internal/workers/{worker_id}/heartbeat", {"state": state})


def test_drain_reaches_the_registry_and_the_heartbeat(staff_client, prefill_client, internal_client):
    worker_id = prefill_client.post(REGISTER_URL, {"address": "127.0.0.1:50061", "name": "p0"}).data["id"]
    response = staff_client.post(drain_url(worker_id))
    assert response.status_code == 200
    assert response.data["state"] == "draining"
    assert response.data["drain_requested_at"] is not None

    registry = internal_client.get(REGISTRY_URL).data["workers"]
    assert [(w["id"], w["state"]) for w in registry] == [(worker_id, "draining")]
    # The worker has not noticed yet and reports ready: the drain wins.
    answer = heartbeat(prefill_client, worker_id, "ready")
    assert answer.status_code == 200 and answer.data == {"state": "draining"}
    assert heartbeat(prefill_client, worker_id, "draining").data == {"state": "draining"}
    assert internal_client.get(REGISTRY_URL).data["workers"][0]["state"] == "draining"

    audit = AuditEvent.objects.get(action="worker.drain")
    assert (audit.organization, audit.actor, audit.target_id) == (None, "staff@diptych.local", worker_id)


def test_draining_twice_keeps_the_first_request_time(staff_client, prefill_client):
    worker_id = prefill_client.post(REGISTER_URL, {"address": "127.0.0.1:50061", "name": "p0"}).data["id"]
    first = staff_client.post(drain_url(worker_id)).data["drain_requested_at"]
    assert staff_client.post(drain_url(worker_id)).data["drain_requested_at"] == first


def test_a_dead_worker_cannot_be_drained(staff_client, prefill_client):
    worker_id = prefill_client.post(REGISTER_URL, {"address": "127.0.0.1:50061", "name": "p0"}).data["id"]
    Worker.objects.filter(public_id=worker_id).update(state="dead")
    response = staff_client.post(drain_url(worker_id))
    assert response.status_code == 410
    assert response.data["error"]["type"] == "worker_dead"
    assert Worker.objects.get(public_id=worker_id).drain_requested_at is None


def test_unknown_worker_is_404(staff_client, db):
    response = staff_client.post(drain_url("wrk_nope"))
    assert response.status_code == 404
    assert "wrk_nope" in response.data["error"]["message"]


def test_only_staff_drain(client_a, prefill_client, org_a):
    worker_id = prefill_client.post(REGISTER_URL, {"address": "127.0.0.1:50061", "name": "p0"}).data["id"]
    response = client_a.post(drain_url(worker_id))
    assert response.status_code == 403
    assert Worker.objects.get(public_id=worker_id).state == "ready"


def test_staff_worker_list_shows_silent_workers_dead_at_once(staff_client, prefill_client, settings):
    worker_id = prefill_client.post(REGISTER_URL, {"address": "127.0.0.1:50061", "name": "p0"}).data["id"]
    Worker.objects.filter(public_id=worker_id).update(
        last_heartbeat_at=timezone.now() - timedelta(seconds=settings.DIPTYCH_WORKER_DEAD_AFTER_SECONDS + 1)
    )
    workers = staff_client.get("/api/v1/workers").data["data"]
    assert [(w["id"], w["state"]) for w in workers] == [(worker_id, "dead")]
    assert staff_client.get("/api/v1/workers", {"state": "dead"}).data["total"] == 0  # not marked yet
    assert staff_client.get("/api/v1/workers", {"state": "zombie"}).status_code == 400


def test_staff_add_prices_and_tenants_read_them(staff_client, client_a, tiny_model):
    created = staff_client.post(
        "/api/v1/prices", {"model": "diptych-tiny", "phase": "decode", "micros_per_million": 400_000}, format="json"
    )
    assert created.status_code == 201
    assert client_a.get("/api/v1/prices", {"model": "diptych-tiny"}).data["data"][0]["micros_per_million"] == 400_000
    refused = client_a.post(
        "/api/v1/prices", {"model": "diptych-tiny", "phase": "decode", "micros_per_million": 1}, format="json"
    )
    assert refused.status_code == 403
    unknown = staff_client.post(
        "/api/v1/prices", {"model": "nope", "phase": "decode", "micros_per_million": 1}, format="json"
    )
    assert unknown.status_code == 404
    past = staff_client.post(
        "/api/v1/prices",
        {"model": "diptych-tiny", "phase": "decode", "micros_per_million": 1, "effective_from": "2021-01-01T00:00:00Z"},
        format="json",
    )
    assert past.status_code == 400 and "past" in past.data["error"]["message"]
    assert client_a.get("/api/v1/prices").data["total"] == 1
