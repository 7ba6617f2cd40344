"""A rolling revision change: a fleet's workers of an earlier revision keep serving until a worker of the
model's current revision is registered and ready in that fleet; then their heartbeats answer "draining"."""

from datetime import timedelta
from pathlib import Path

import pytest
from django.utils import timezone

from controlplane.catalog.models import FleetRole, Model, Worker
from controlplane.catalog.services import model_ensure, model_publish, publication_prepare
from tests.platform.conftest import bearer_client, make_fleet

REGISTER_URL = "/api/v1/internal/workers/register"
REGISTRY_URL = "/api/v1/internal/registry"


@pytest.fixture(autouse=True)
def store_root(settings, tmp_path) -> Path:
    settings.DIPTYCH_ARTIFACT_STORE = ""
    settings.DIPTYCH_ARTIFACT_DIR = tmp_path / "artifact-store"
    return settings.DIPTYCH_ARTIFACT_DIR


@pytest.fixture
def art_model(db) -> Model:
    return model_ensure(name="tiny-art", source="x", context_length=512, family="llama", dtype="float32")


@pytest.fixture
def publish(art_model, tmp_path):
    def publish_revision(revision: str) -> None:
        directory = tmp_path / "published" / revision
        directory.mkdir(parents=True, exist_ok=True)
        (directory / "config.json").write_text('{"max_position_embeddings": 512}')
        (directory / "model.safetensors").write_bytes(f"weights of {revision}".encode())
        publication = publication_prepare(model_name="tiny-art", directory=directory, revision=revision)
        model_publish(model=art_model, publication=publication)

    return publish_revision


@pytest.fixture
def prefill(art_model):
    return bearer_client(make_fleet(art_model, FleetRole.PREFILL, "tiny-art-prefill").token)


@pytest.fixture
def decode(art_model):
    return bearer_client(make_fleet(art_model, FleetRole.DECODE, "tiny-art-decode").token)


def register(client, port: int, revision: str) -> str:
    body = {"address": f"127.0.0.1:{port}", "name": f"w{port}", "revision": revision}
    response = client.post(REGISTER_URL, body)
    assert response.status_code == 201, response.json()
    return response.json()["id"]


def heartbeat(client, worker_id: str, state: str = "ready") -> str:
    response = client.post(f"/api/v1/internal/workers/{worker_id}/heartbeat", {"state": state})
    assert response.status_code == 200, response.json()
    return response.json()["state"]


def test_old_workers_serve_until_a_new_revision_worker_is_ready_then_drain(publish, prefill, internal_client):
    publish("r1")
    old = [register(prefill, 50061, "r1"), register(prefill, 50062, "r1")]
    assert [heartbeat(prefill, worker) for worker in old] == ["ready", "ready"]

    publish("r2")
    # No worker of r2 yet: the old ones keep serving, however often they heartbeat.
    assert [heartbeat(prefill, worker) for worker in old] == ["ready", "ready"]
    assert [heartbeat(prefill, worker) for worker in old] == ["ready", "ready"]

    new = register(prefill, 50063, "r2")
    assert heartbeat(prefill, new) == "ready"
    assert [heartbeat(prefill, worker) for worker in old] == ["draining", "draining"]
    registry = {w["id"]: (w["revision"], w["state"]) for w in internal_client.get(REGISTRY_URL).json()["workers"]}
    assert registry == {old[0]: ("r1", "draining"), old[1]: ("r1", "draining"), new: ("r2", "ready")}


def test_a_new_revision_worker_that_is_not_ready_drains_nobody(publish, prefill, settings):
    publish("r1")
    old = register(prefill, 50061, "r1")
    publish("r2")

    draining_new = register(prefill, 50062, "r2")
    assert heartbeat(prefill, draining_new, "draining") == "draining"  # e.g. shutting down
    assert heartbeat(prefill, old) == "ready"

    silent_new = register(prefill, 50063, "r2")
    Worker.objects.filter(public_id=silent_new).update(
        last_heartbeat_at=timezone.now() - timedelta(seconds=settings.DIPTYCH_WORKER_DEAD_AFTER_SECONDS + 1)
    )
    assert heartbeat(prefill, old) == "ready"

    dead_new = register(prefill, 50064, "r2")
    Worker.objects.filter(public_id=dead_new).update(state="dead")
    assert heartbeat(prefill, old) == "ready"


def test_a_worker_of_no_revision_drains_too(publish, prefill):
    publish("r1")
    local = prefill.post(REGISTER_URL, {"address": "127.0.0.1:50061", "name": "local"}).json()["id"]
    assert heartbeat(prefill, local) == "ready"
    register(prefill, 50062, "r1")
    assert heartbeat(prefill, local) == "draining"


def test_a_revision_change_back_and_forth(publish, prefill):
    publish("r1")
    first = register(prefill, 50061, "r1")
    publish("r2")
    second = register(prefill, 50062, "r2")
    assert heartbeat(prefill, first) == "draining"

    publish("r1")  # back: the same content again, r1 is current once more
    assert Model.objects.get(name="tiny-art").revision == "r1"
    # The r1 worker is draining (it stays so: a worker never leaves a drain), so r2 keeps serving.
    assert heartbeat(prefill, first, "draining") == "draining"
    assert heartbeat(prefill, second) == "ready"

    third = register(prefill, 50063, "r1")
    assert heartbeat(prefill, third) == "ready"
    assert heartbeat(prefill, second) == "draining"

    publish("r2")  # and forth again: the r2 worker is already draining, the r1 worker serves until one is ready
    assert heartbeat(prefill, third) == "ready"
    fourth = register(prefill, 50064, "r2")
    assert (heartbeat(prefill, fourth), heartbeat(prefill, third)) == ("ready", "draining")


def test_workers_of_other_fleets_are_untouched(publish, prefill, decode, prefill_client):
    publish("r1")
    old_decode = register(decode, 50071, "r1")
    builtin = prefill_client.post(REGISTER_URL, {"address": "127.0.0.1:50081", "name": "builtin"}).json()["id"]
    old_prefill = register(prefill, 50061, "r1")
    publish("r2")
    register(prefill, 50062, "r2")

    assert heartbeat(prefill, old_prefill) == "draining"
    # The decode fleet has no worker of r2 yet: its r1 worker keeps serving. Another model's fleet: untouched.
    assert heartbeat(decode, old_decode) == "ready"
    assert heartbeat(prefill_client, builtin) == "ready"

    register(decode, 50072, "r2")
    assert heartbeat(decode, old_decode) == "draining"
    assert heartbeat(prefill_client, builtin) == "ready"


def test_a_staff_drained_new_revision_worker_drains_nobody(publish, prefill, staff_client):
    publish("r1")
    old = register(prefill, 50061, "r1")
    publish("r2")
    new = register(prefill, 50062, "r2")
    assert staff_client.post(f"/api/v1/workers/{new}/drain").status_code == 200
    assert heartbeat(prefill, new) == "draining"
    assert heartbeat(prefill, old) == "ready"


def test_a_model_given_a_builtin_source_again_drains_nobody(publish, prefill, internal_client):
    publish("r1")
    old = register(prefill, 50061, "r1")
    model_ensure(name="tiny-art", source="builtin:diptych-tiny", context_length=512, family="llama", dtype="float32")
    local = prefill.post(REGISTER_URL, {"address": "127.0.0.1:50062", "name": "local"}).json()["id"]
    assert (heartbeat(prefill, old), heartbeat(prefill, local)) == ("ready", "ready")
    assert prefill.get("/api/v1/internal/artifacts/manifest").json()["revision"] == ""
