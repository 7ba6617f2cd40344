"""`diptych model register` through the control plane's internal API (`POST /api/v1/internal/models/register`,
the internal token only): a model directory's files, one multipart part each, published as a revision of
the model, with its prefill, decode and colocated fleets. Bad input is a 400 naming the field that changes
nothing; registering again keeps the fleets' tokens; the command's options and output are as before."""

import hashlib
import json
import os
import socket
import subprocess
import sys
import threading
from pathlib import Path

import pytest
from django.core.files.uploadedfile import SimpleUploadedFile
from django.db import connection
from rest_framework.response import Response
from rest_framework.test import APIClient

from controlplane.catalog import services as catalog_services
from controlplane.catalog.artifact_store import LocalArtifactStore
from controlplane.catalog.models import ARTIFACTS_SOURCE, Fleet, FleetRole, Model
from controlplane.tenancy.models import AuditEvent
from diptych_common.artifacts import model_directory_files
from diptych_common.internal_api.endpoints import ARTIFACT_MANIFEST, MODEL_REGISTER
from diptych_common.internal_api.messages import ModelRegistration
from tests.platform.conftest import INTERNAL_TOKEN, bearer_client
from tests.platform.test_platform_artifacts import (
    CONFIG,
    content_revision,
    expected_files,
    recorded_files,
    stored_files,
    write_model_directory,
)

ROLES = set(FleetRole.values)


@pytest.fixture
def store_root(settings, tmp_path) -> Path:
    settings.DIPTYCH_ARTIFACT_STORE = ""
    settings.DIPTYCH_ARTIFACT_DIR = tmp_path / "artifact-store"
    return settings.DIPTYCH_ARTIFACT_DIR


@pytest.fixture
def model_directory(tmp_path) -> Path:
    return write_model_directory(tmp_path / "tiny-art")


def form(directory: Path, name: str = "tiny-art", revision: str = "", **overrides) -> dict:
    """The multipart form the command line sends for `directory`: the registration and a part per file."""
    paths = model_directory_files(directory)
    registration = ModelRegistration(
        name=name,
        context_length=CONFIG["max_position_embeddings"],
        family=CONFIG["model_type"],
        dtype=CONFIG["torch_dtype"],
        revision=revision,
        paths=tuple(paths),
    )
    files = [SimpleUploadedFile(path, (directory / path).read_bytes()) for path in paths]
    return {**registration.to_wire(), "files": files, **overrides}


def register(client: APIClient, body: dict):
    return client.post(MODEL_REGISTER.path, body, format="multipart")


def token_hashes(name: str) -> dict[str, str]:
    return dict(Fleet.objects.filter(model__name=name).values_list("role", "token_hash"))


def test_a_directory_becomes_a_published_model_with_its_fleets(db, store_root, internal_client, model_directory):
    response = register(internal_client, form(model_directory, revision="r1"))

    assert response.status_code == 200, response.json()
    body = response.json()
    assert (body["name"], body["context_length"], body["revision"]) == ("tiny-art", 512, "r1")
    assert set(body["fleet_tokens"]) == ROLES
    model = Model.objects.get(name="tiny-art")
    assert (model.source, model.revision, model.family, model.dtype) == (ARTIFACTS_SOURCE, "r1", "llama", "float32")
    files = expected_files(model_directory)
    assert recorded_files(model, "r1") == files
    for path in files:
        assert (store_root / "tiny-art" / "r1" / path).read_bytes() == (model_directory / path).read_bytes()
    assert set(Fleet.objects.filter(model=model).values_list("name", flat=True)) == {
        "tiny-art-prefill",
        "tiny-art-decode",
        "tiny-art-colocated",
    }
    manifest = bearer_client(body["fleet_tokens"]["colocated"]).get(ARTIFACT_MANIFEST.path)
    assert manifest.status_code == 200 and manifest.json()["revision"] == "r1"
    assert AuditEvent.objects.filter(action="model.publish", target_id="tiny-art").count() == 1


def test_a_model_larger_than_any_other_body_is_taken(db, store_root, internal_client, model_directory, settings):
    settings.DATA_UPLOAD_MAX_MEMORY_SIZE = 64 * 1024  # other endpoints answer 413 above it; the weights are 256 KiB
    assert register(internal_client, form(model_directory)).status_code == 200


@pytest.mark.parametrize("token", [None, "not-the-token", "fleet", "api key"])
def test_only_the_internal_token_registers(store_root, model_directory, prefill_fleet, key_a, token):
    tokens = {"fleet": prefill_fleet.token, "api key": key_a.key}
    client = APIClient() if token is None else bearer_client(tokens.get(token, token))
    response = register(client, form(model_directory))
    assert response.status_code == 401
    assert not Model.objects.filter(name="tiny-art").exists()
    assert not store_root.exists()


@pytest.mark.parametrize(
    ("overrides", "field", "message"),
    [
        ({"name": "tiny art"}, "name", "Not allowed: use 1 to 90 letters"),
        ({"context_length": 0}, "context_length", "greater than or equal to 1"),
        ({"paths": ["config.json", "model.safetensors"]}, "paths", "One path per file, in their order: 2 for 3"),
        ({"paths": ["config.json", "../model.safetensors", "t.json"]}, "paths[1]", "cannot be published"),
        ({"paths": ["config.json", "/etc/passwd", "t.json"]}, "paths[1]", "give a relative POSIX path"),
        ({"paths": ["config.json", "a" * 256, "t.json"]}, "paths[1]", "over 255 bytes"),
        ({"paths": ["config.json", ".env", "t.json"]}, "paths[1]", "dot-file"),
        ({"paths": ["config.json", "config.json", "t.json"]}, "paths[1]", "'config.json' is named twice"),
        ({"paths": ["config.json", "t", "t/t.json"]}, "paths[1]", "'t' is named twice, as a file or as a folder"),
        ({"revision": "-r1"}, "revision", "Invalid revision."),
    ],
)
def test_bad_input_is_a_400_naming_the_field_and_changes_nothing(
    db, store_root, internal_client, model_directory, overrides, field, message
):
    response = register(internal_client, form(model_directory, **overrides))
    assert response.status_code == 400, response.json()
    error = response.json()["error"]
    assert error["type"] == "validation_error"
    assert message in " ".join(error["fields"][field])
    assert not Model.objects.filter(name="tiny-art").exists()
    assert not Fleet.objects.filter(name__startswith="tiny-art").exists()
    assert not store_root.exists()


def test_other_files_under_a_published_revision_are_refused_and_change_nothing(
    db, store_root, internal_client, model_directory, tmp_path
):
    assert register(internal_client, form(model_directory, revision="r1")).status_code == 200
    tokens_before = token_hashes("tiny-art")
    changed = write_model_directory(tmp_path / "changed", weights=b"other weights")

    response = register(internal_client, form(changed, revision="r1"))

    assert response.status_code == 400
    assert (
        "Revision 'r1' of model 'tiny-art' is already published with other content"
        in response.json()["error"]["message"]
    )
    assert token_hashes("tiny-art") == tokens_before
    assert recorded_files(Model.objects.get(name="tiny-art"), "r1") == expected_files(model_directory)
    assert (store_root / "tiny-art" / "r1" / "model.safetensors").read_bytes() == (
        model_directory / "model.safetensors"
    ).read_bytes()


def test_registering_again_keeps_the_fleets_tokens(db, store_root, internal_client, model_directory, tmp_path):
    assert register(internal_client, form(model_directory, revision="r1")).status_code == 200
    tokens_before = token_hashes("tiny-art")

    again = register(internal_client, form(model_directory, revision="r1"))
    assert again.status_code == 200
    assert (again.json()["revision"], again.json()["fleet_tokens"]) == ("r1", {})

    changed = write_model_directory(tmp_path / "changed", weights=b"other weights")
    revised = register(internal_client, form(changed))  # a content-named revision
    assert revised.status_code == 200
    assert (revised.json()["revision"], revised.json()["fleet_tokens"]) == (
        content_revision(expected_files(changed)),
        {},
    )
    assert Model.objects.get(name="tiny-art").revision == revised.json()["revision"]
    assert token_hashes("tiny-art") == tokens_before


def test_a_model_whose_fleets_lack_tokens_gets_fresh_ones_for_every_role(
    store_root, internal_client, model_directory, prefill_fleet
):
    """diptych-tiny has a prefill fleet with a token but no decode or colocated one: as bootstrap does, every
    fleet gets a fresh token, and the old one stops working."""
    response = register(internal_client, form(model_directory, name="diptych-tiny"))
    assert response.status_code == 200
    assert set(response.json()["fleet_tokens"]) == ROLES
    assert bearer_client(prefill_fleet.token).get(ARTIFACT_MANIFEST.path).status_code == 401
    assert Model.objects.get(name="diptych-tiny").source == ARTIFACTS_SOURCE


def test_the_refused_one_of_two_concurrent_registrations_leaves_nothing_in_the_store(
    transactional_db, store_root, internal_client, model_directory, tmp_path, monkeypatch
):
    """Two registrations of revision r1 with other files, interleaved as the race needs: the late one passes
    its first check while nothing is recorded, and writes to the store only once the other was accepted. The
    store then holds exactly the accepted files' bytes, and nothing the refused one sent."""
    late_directory = write_model_directory(tmp_path / "late", weights=b"the late registration's weights")
    late_at_store, first_done = threading.Event(), threading.Event()
    answers: dict[str, Response] = {}

    class LateWriterStore(LocalArtifactStore):
        def put(self, key: str, source: Path) -> None:
            if threading.current_thread() is late and not late_at_store.is_set():
                late_at_store.set()
                if not first_done.wait(timeout=60):
                    raise TimeoutError("the first registration did not finish")
            super().put(key, source)

    def register_late() -> None:
        try:
            answers["late"] = register(bearer_client(INTERNAL_TOKEN), form(late_directory, revision="r1"))
        finally:
            connection.close()

    monkeypatch.setattr(catalog_services, "artifact_store", lambda: LateWriterStore(root=store_root))
    late = threading.Thread(target=register_late)
    late.start()
    try:
        assert late_at_store.wait(timeout=60), "the late registration never reached the store"
        answers["first"] = register(internal_client, form(model_directory, revision="r1"))
    finally:
        first_done.set()
        late.join(timeout=60)

    assert answers["first"].status_code == 200, answers["first"].json()
    assert answers["late"].status_code == 400, answers["late"].json()
    assert "already published with other content" in answers["late"].json()["error"]["message"]
    accepted = expected_files(model_directory)
    assert recorded_files(Model.objects.get(name="tiny-art"), "r1") == accepted
    stored = {key: hashlib.sha256(content).hexdigest() for key, content in stored_files(store_root).items()}
    assert stored == {f"tiny-art/r1/{path}": sha256 for path, (_, sha256) in accepted.items()}


# ---- the command ----------------------------------------------------------------------------------------


def diptych(*args: str, **env: str) -> subprocess.CompletedProcess:
    """`diptych ARGS` in a process of its own, without the control plane's database: it calls the API only."""
    environment = {name: value for name, value in os.environ.items() if name != "DATABASE_URL"} | env
    return subprocess.run(
        [sys.executable, "-m", "diptych_server.cli", *args], env=environment, capture_output=True, text=True
    )


@pytest.mark.django_db(transaction=True)
def test_the_command_registers_through_the_api_and_prints_as_before(store_root, live_server, model_directory, tmp_path):
    command = ["model", "register", "tiny-art", "--control-plane-url", live_server.url]
    registered = diptych(
        *command, str(model_directory), "--revision", "r1", "--json", DIPTYCH_INTERNAL_TOKEN=INTERNAL_TOKEN
    )
    assert registered.returncode == 0, registered.stderr
    printed = json.loads(registered.stdout)
    assert (printed["model"], printed["source"], printed["revision"]) == (
        "tiny-art",
        str(model_directory.resolve()),
        "r1",
    )
    assert set(printed["fleet_tokens"]) == ROLES
    assert Model.objects.get(name="tiny-art").revision == "r1"

    changed = write_model_directory(tmp_path / "changed", weights=b"other weights")
    refused = diptych(*command, str(changed), "--revision", "r1", DIPTYCH_INTERNAL_TOKEN=INTERNAL_TOKEN)
    assert refused.returncode == 2
    assert refused.stderr.startswith(
        "diptych model register: Revision 'r1' of model 'tiny-art' is already published with other content"
    )

    revised = diptych(*command, str(changed), "--revision", "r2", DIPTYCH_INTERNAL_TOKEN=INTERNAL_TOKEN)
    assert revised.returncode == 0, revised.stderr
    assert revised.stdout == (
        f"tiny-art ({changed.resolve()}, 512 tokens of context) is in the catalog, published as revision r2; "
        "workers of an earlier revision drain once one of this revision is ready.\n"
        "Its fleets keep their tokens: start its workers with them (diptych worker --role ROLE).\n"
    )


def test_the_command_says_when_the_control_plane_is_not_there_or_refuses_its_token(model_directory):
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        closed = f"http://127.0.0.1:{probe.getsockname()[1]}"
    command = ["model", "register", "tiny-art", str(model_directory), "--control-plane-url", closed]
    unreachable = diptych(*command, DIPTYCH_INTERNAL_TOKEN=INTERNAL_TOKEN)
    assert unreachable.returncode == 2
    assert f"the control plane at {closed} is not available (ConnectError" in unreachable.stderr
    assert "start the platform first (`diptych up`)" in unreachable.stderr

    without_token = diptych(*command, DIPTYCH_INTERNAL_TOKEN="")
    assert without_token.returncode == 1
    assert "set DIPTYCH_INTERNAL_TOKEN" in without_token.stderr


@pytest.mark.django_db(transaction=True)
def test_the_command_names_a_refused_token(live_server, model_directory):
    command = ["model", "register", "tiny-art", str(model_directory), "--control-plane-url", live_server.url]
    refused = diptych(*command, DIPTYCH_INTERNAL_TOKEN="not-the-token")
    assert refused.returncode == 2
    assert "the control plane refused the internal token (DIPTYCH_INTERNAL_TOKEN): Invalid internal service token." in (
        refused.stderr
    )
