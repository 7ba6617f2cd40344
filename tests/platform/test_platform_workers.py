from datetime import datetime, timedelta

import pytest
from django.utils import timezone

from controlplane.catalog.models import Worker, WorkerState
from controlplane.catalog.services import fleet_token_rotate, workers_mark_silent_dead
from controlplane.catalog.tasks import mark_silent_workers_dead
from controlplane.celery import app as celery_app

REGISTER_URL = "/api/v1/internal/workers/register"
REGISTRY_URL = "/api/v1/internal/registry"
LOAD = {
    "queue_depth": 3,
    "active_sequences": 5,
    "kv_blocks_free": 100,
    "kv_blocks_total": 256,
    "tokens_per_second": 812.5,
}


def heartbeat_url(worker_id: str) -> str:
    return f"/api/v1/internal/workers/{worker_id}/heartbeat"


def register(client, address="127.0.0.1:50061", name="prefill-0") -> str:
    response = client.post(REGISTER_URL, {"address": address, "name": name})
    assert response.status_code == 201, response.data
    return response.data["id"]


def silence(worker_id: str, seconds: int) -> None:
    Worker.objects.filter(public_id=worker_id).update(last_heartbeat_at=timezone.now() - timedelta(seconds=seconds))


def test_register_answers_the_id_fleet_and_heartbeat_interval(prefill_client, settings):
    settings.DIPTYCH_HEARTBEAT_INTERVAL_SECONDS = 3
    response = prefill_client.post(REGISTER_URL, {"address": "127.0.0.1:50061", "name": "prefill-0"})
    assert response.status_code == 201
    assert response.data["id"].startswith("wrk_")
    assert response.data["fleet"] == {
        "name": "tiny-prefill",
        "role": "prefill",
        "model": "diptych-tiny",
        "region": "local",
        "hardware_class": "cpu",
    }
    assert response.data["heartbeat_interval_seconds"] == 3
    worker = Worker.objects.get(public_id=response.data["id"])
    assert (worker.address, worker.name, worker.state) == ("127.0.0.1:50061", "prefill-0", WorkerState.READY)


@pytest.mark.parametrize(
    ("body", "field"),
    [
        ({"name": "p"}, "address"),
        ({"address": "127.0.0.1", "name": "p"}, "address"),
        ({"address": "127.0.0.1:0", "name": "p"}, "address"),
        ({"address": "127.0.0.1:70000", "name": "p"}, "address"),
        ({"address": ":50061", "name": "p"}, "address"),
        ({"address": "127.0.0.1:50061"}, "name"),
    ],
)
def test_register_rejects_bad_input(prefill_client, body, field):
    response = prefill_client.post(REGISTER_URL, body)
    assert response.status_code == 400
    assert field in response.data["error"]["fields"]
    assert Worker.objects.count() == 0


def test_register_accepts_ipv6_addresses(prefill_client):
    register(prefill_client, address="[::1]:50061")


def test_register_refuses_unknown_and_rotated_fleet_tokens(prefill_fleet, make_bearer_client):
    old_client = make_bearer_client(prefill_fleet.token)
    fleet_token_rotate(fleet=prefill_fleet.fleet)
    response = old_client.post(REGISTER_URL, {"address": "127.0.0.1:50061", "name": "p"})
    assert response.status_code == 401
    assert response.data["error"]["type"] == "fleet_token_not_recognised"
    assert Worker.objects.count() == 0


def test_heartbeat_records_state_and_load(prefill_client):
    worker_id = register(prefill_client)
    before = Worker.objects.get(public_id=worker_id).last_heartbeat_at
    response = prefill_client.post(heartbeat_url(worker_id), {"state": "draining", **LOAD})
    assert response.status_code == 200
    assert response.data == {"state": "draining"}
    worker = Worker.objects.get(public_id=worker_id)
    assert worker.state == WorkerState.DRAINING
    assert worker.last_heartbeat_at >= before
    assert {field: getattr(worker, field) for field in LOAD} == LOAD


def test_heartbeat_load_fields_default_to_zero(prefill_client):
    worker_id = register(prefill_client)
    prefill_client.post(heartbeat_url(worker_id), {"state": "ready", **LOAD})
    response = prefill_client.post(heartbeat_url(worker_id), {"state": "ready"})
    assert response.status_code == 200
    worker = Worker.objects.get(public_id=worker_id)
    assert {field: getattr(worker, field) for field in LOAD} == dict.fromkeys(LOAD, 0)


@pytest.mark.parametrize(
    ("body", "field"),
    [
        ({}, "state"),
        ({"state": "dead"}, "state"),
        ({"state": "ready", "queue_depth": -1}, "queue_depth"),
        ({"state": "ready", "tokens_per_second": -0.5}, "tokens_per_second"),
        ({"state": "ready", "kv_blocks_free": 10, "kv_blocks_total": 5}, "kv_blocks_free"),
        ({"state": "ready", "active_sequences": "many"}, "active_sequences"),
    ],
)
def test_heartbeat_rejects_bad_input_and_changes_nothing(prefill_client, body, field):
    worker_id = register(prefill_client)
    before = Worker.objects.values().get(public_id=worker_id)
    response = prefill_client.post(heartbeat_url(worker_id), body)
    assert response.status_code == 400
    assert field in response.data["error"]["fields"]
    assert Worker.objects.values().get(public_id=worker_id) == before


def test_heartbeat_of_an_unknown_worker_is_404(prefill_client):
    response = prefill_client.post(heartbeat_url("wrk_doesnotexist"), {"state": "ready"})
    assert response.status_code == 404
    assert response.data["error"]["type"] == "not_found"


def test_heartbeat_with_another_fleets_token_is_404(prefill_client, decode_client):
    worker_id = register(prefill_client)
    response = decode_client.post(heartbeat_url(worker_id), {"state": "draining"})
    assert response.status_code == 404
    assert Worker.objects.get(public_id=worker_id).state == WorkerState.READY


def test_a_worker_marked_dead_that_heartbeats_again_is_live_again_under_its_id(
    prefill_client, internal_client, settings
):
    # What a control-plane outage longer than the deadline looks like: the worker heartbeated into the void,
    # the periodic job marked it dead; its first heartbeat afterwards brings it back without registering.
    settings.DIPTYCH_WORKER_DEAD_AFTER_SECONDS = 10
    worker_id = register(prefill_client)
    silence(worker_id, seconds=30)
    assert workers_mark_silent_dead() == 1
    response = prefill_client.post(heartbeat_url(worker_id), {"state": "ready", **LOAD})
    assert response.status_code == 200 and response.data == {"state": "ready"}
    assert Worker.objects.get(public_id=worker_id).state == WorkerState.READY
    assert [worker["id"] for worker in internal_client.get(REGISTRY_URL).data["workers"]] == [worker_id]


def test_a_revived_worker_keeps_a_drain_staff_requested(prefill_client, staff_client):
    worker_id = register(prefill_client)
    staff_client.post(f"/api/v1/workers/{worker_id}/drain")
    Worker.objects.filter(public_id=worker_id).update(state=WorkerState.DEAD)
    assert prefill_client.post(heartbeat_url(worker_id), {"state": "ready"}).data == {"state": "draining"}


def test_late_heartbeat_is_accepted_even_before_the_periodic_job_ran(prefill_client, settings):
    settings.DIPTYCH_WORKER_DEAD_AFTER_SECONDS = 10
    worker_id = register(prefill_client)
    silence(worker_id, seconds=11)
    response = prefill_client.post(heartbeat_url(worker_id), {"state": "ready"})
    assert response.status_code == 200
    assert Worker.objects.get(public_id=worker_id).state == WorkerState.READY


def test_dead_worker_re_registers_and_the_registry_lists_one_worker_per_address(prefill_client, internal_client):
    first_id = register(prefill_client)
    Worker.objects.filter(public_id=first_id).update(state=WorkerState.DEAD)

    second_id = register(prefill_client)
    assert second_id != first_id
    assert prefill_client.post(heartbeat_url(second_id), {"state": "ready"}).status_code == 200
    workers = internal_client.get(REGISTRY_URL).data["workers"]
    assert [worker["id"] for worker in workers] == [second_id]


def test_re_registering_a_live_address_replaces_the_old_worker(prefill_client, internal_client):
    first_id = register(prefill_client)
    second_id = register(prefill_client, name="prefill-0-restarted")
    assert Worker.objects.get(public_id=first_id).state == WorkerState.DEAD
    assert prefill_client.post(heartbeat_url(first_id), {"state": "ready"}).status_code == 410
    live = Worker.objects.exclude(state=WorkerState.DEAD)
    assert list(live.values_list("public_id", flat=True)) == [second_id]
    assert [worker["id"] for worker in internal_client.get(REGISTRY_URL).data["workers"]] == [second_id]


def test_registry_lists_models_and_only_live_workers(
    prefill_client, decode_client, internal_client, settings, tiny_model
):
    settings.DIPTYCH_WORKER_DEAD_AFTER_SECONDS = 10
    ready_id = register(prefill_client, address="127.0.0.1:50061", name="prefill-0")
    draining_id = register(decode_client, address="127.0.0.1:50071", name="decode-0")
    silent_id = register(prefill_client, address="127.0.0.1:50062", name="prefill-1")
    dead_id = register(decode_client, address="127.0.0.1:50072", name="decode-1")
    decode_client.post(heartbeat_url(draining_id), {"state": "draining", **LOAD})
    silence(silent_id, seconds=11)
    Worker.objects.filter(public_id=dead_id).update(state=WorkerState.DEAD)

    response = internal_client.get(REGISTRY_URL)
    assert response.status_code == 200
    (model,) = response.data["models"]
    assert datetime.fromisoformat(model.pop("created_at")) == tiny_model.created_at  # GET /v1/models' `created`
    assert model == {"name": "diptych-tiny", "source": "builtin:diptych-tiny", "context_length": 1024, "revision": ""}
    workers = {worker["id"]: worker for worker in response.data["workers"]}
    assert set(workers) == {ready_id, draining_id}
    draining = workers[draining_id]
    assert draining == {
        "id": draining_id,
        "name": "decode-0",
        "role": "decode",
        "model": "diptych-tiny",
        "region": "local",
        "hardware_class": "cpu",
        "address": "127.0.0.1:50071",
        "state": "draining",
        "revision": "",
        **LOAD,
        "last_heartbeat_at": draining["last_heartbeat_at"],
    }
    assert draining["last_heartbeat_at"]


def test_mark_silent_workers_dead_marks_only_silent_live_workers(prefill_client, settings):
    settings.DIPTYCH_WORKER_DEAD_AFTER_SECONDS = 10
    fresh_id = register(prefill_client, address="127.0.0.1:50061")
    silent_ids = [register(prefill_client, address=f"127.0.0.1:5006{port}") for port in (2, 3)]
    for worker_id in silent_ids:
        silence(worker_id, seconds=30)
    prefill_client.post(heartbeat_url(silent_ids[1]), {"state": "draining"})  # late, but alive after all

    assert workers_mark_silent_dead() == 1
    states = dict(Worker.objects.values_list("public_id", "state"))
    assert states == {fresh_id: "ready", silent_ids[0]: "dead", silent_ids[1]: "draining"}
    assert workers_mark_silent_dead() == 0


def test_mark_silent_workers_dead_task_runs_the_service(prefill_client, settings):
    settings.DIPTYCH_WORKER_DEAD_AFTER_SECONDS = 10
    worker_id = register(prefill_client)
    silence(worker_id, seconds=11)
    result = mark_silent_workers_dead.apply()
    assert result.successful()
    assert result.get() == 1
    assert Worker.objects.get(public_id=worker_id).state == WorkerState.DEAD


def test_the_task_is_registered_and_scheduled():
    task_name = "controlplane.catalog.tasks.mark_silent_workers_dead"
    assert mark_silent_workers_dead.name == task_name
    celery_app.loader.import_default_modules()
    assert task_name in celery_app.tasks
    assert task_name in {entry["task"] for entry in celery_app.conf.beat_schedule.values()}
