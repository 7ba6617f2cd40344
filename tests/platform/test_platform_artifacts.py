"""Model artifacts by name and revision: publishing hashes and stores every file, a revision's files never
change, and workers read their own fleet's model's manifest and files (local store served by the control
plane, or S3-compatible storage, here moto's server on loopback)."""

import hashlib
import json
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from rest_framework.test import APIClient

from controlplane.catalog.artifact_store import LocalArtifactStore, S3ArtifactStore
from controlplane.catalog.models import FleetRole, Model, ModelFile, Worker
from controlplane.catalog.services import model_ensure, model_publish, publication_prepare
from controlplane.common.errors import InvalidInput
from controlplane.tenancy.models import AuditEvent
from tests.platform.conftest import bearer_client, make_fleet

MANIFEST_URL = "/api/v1/internal/artifacts/manifest"
FILES_URL = "/api/v1/internal/artifacts/files"
REGISTER_URL = "/api/v1/internal/workers/register"
REGISTRY_URL = "/api/v1/internal/registry"
WEIGHTS = bytes(range(256)) * 1024 + b"tail"  # 256 KiB and a bit: more than one streamed chunk is not needed
CONFIG = {"model_type": "llama", "max_position_embeddings": 512, "torch_dtype": "float32"}
MODEL_PATHS = ["config.json", "model.safetensors", "tokenizer/tokenizer.json"]  # what write_model_directory publishes


def write_model_directory(directory: Path, weights: bytes = WEIGHTS) -> Path:
    (directory / "tokenizer").mkdir(parents=True)
    (directory / "config.json").write_text(json.dumps(CONFIG))
    (directory / "model.safetensors").write_bytes(weights)
    (directory / "tokenizer" / "tokenizer.json").write_text('{"version": "1.0"}')
    (directory / ".DS_Store").write_bytes(b"not part of the model")
    (directory / ".git").mkdir()
    (directory / ".git" / "HEAD").write_text("ref: refs/heads/main\n")
    return directory


def expected_files(directory: Path) -> dict[str, tuple[int, str]]:
    return {
        path: ((directory / path).stat().st_size, hashlib.sha256((directory / path).read_bytes()).hexdigest())
        for path in MODEL_PATHS
    }


def content_revision(files: dict[str, tuple[int, str]]) -> str:
    lines = sorted(f"{sha256}  {path}\n" for path, (_, sha256) in files.items())
    return hashlib.sha256("".join(lines).encode()).hexdigest()[:12]


def recorded_files(model: Model, revision: str) -> dict[str, tuple[int, str]]:
    rows = ModelFile.objects.filter(model=model, revision=revision).values_list("path", "size", "sha256")
    return {path: (size, sha256) for path, size, sha256 in rows}


def stored_files(root: Path) -> dict[str, bytes]:
    """Every file under the local store's root (dot-files included) by its key; a leftover folder, too, as b""."""
    entries = sorted(root.rglob("*"))
    leftover_folders = [entry for entry in entries if entry.is_dir() and not any(entry.iterdir())]
    files = {entry.relative_to(root).as_posix(): entry.read_bytes() for entry in entries if entry.is_file()}
    return files | {folder.relative_to(root).as_posix(): b"" for folder in leftover_folders}


def publish(model: Model, directory: Path, revision: str = ""):
    return model_publish(
        model=model, publication=publication_prepare(model_name=model.name, directory=directory, revision=revision)
    )


@pytest.fixture
def store_root(settings, tmp_path) -> Path:
    settings.DIPTYCH_ARTIFACT_STORE = ""
    settings.DIPTYCH_ARTIFACT_DIR = tmp_path / "artifact-store"
    return settings.DIPTYCH_ARTIFACT_DIR


@pytest.fixture
def model_directory(tmp_path) -> Path:
    return write_model_directory(tmp_path / "tiny-art")


@pytest.fixture
def art_model(db, model_directory) -> Model:
    return model_ensure(
        name="tiny-art", source=str(model_directory), context_length=512, family="llama", dtype="float32"
    )


@pytest.fixture
def art_client(art_model) -> APIClient:
    return bearer_client(make_fleet(art_model, FleetRole.PREFILL, "tiny-art-prefill").token)


# ---- publishing -----------------------------------------------------------------------------------------


def test_publishing_records_every_files_sha256_and_size_and_stores_its_bytes(store_root, art_model, model_directory):
    published = publish(art_model, model_directory)

    files = expected_files(model_directory)
    assert published.revision == content_revision(files)
    assert recorded_files(art_model, published.revision) == files  # dot-files and dot-folders left out
    for path in files:
        stored = store_root / "tiny-art" / published.revision / path
        assert stored.read_bytes() == (model_directory / path).read_bytes()
    assert not list(store_root.rglob(".*"))  # no temporary or dot-file left in the store
    art_model.refresh_from_db()
    assert (art_model.revision, art_model.source) == (published.revision, "artifacts")
    audit = AuditEvent.objects.get(action="model.publish")
    assert audit.details == {"revision": published.revision, "files": 3, "bytes": sum(s for s, _ in files.values())}


def test_an_explicit_revision_names_the_publication(store_root, art_model, model_directory):
    assert publish(art_model, model_directory, revision="v1.0").revision == "v1.0"
    assert (store_root / "tiny-art" / "v1.0" / "model.safetensors").read_bytes() == WEIGHTS
    assert Model.objects.get(pk=art_model.pk).revision == "v1.0"


def test_same_revision_with_other_content_is_refused_and_changes_nothing(
    store_root, art_model, model_directory, tmp_path
):
    publish(art_model, model_directory, revision="r1")
    publish(art_model, write_model_directory(tmp_path / "second", weights=WEIGHTS[::-1]), revision="r2")
    # Same size, other bytes: only the digest tells them apart.
    changed = write_model_directory(tmp_path / "changed", weights=WEIGHTS[:-4] + b"TAIL")
    rows_before = list(ModelFile.objects.order_by("id").values())
    audits_before = AuditEvent.objects.count()

    with pytest.raises(InvalidInput, match=r"'r1'.*already published with other content.*model\.safetensors"):
        publication_prepare(model_name="tiny-art", directory=changed, revision="r1")
    # A publication checked before a conflicting one was recorded is refused again when it is recorded.
    stale = publication_prepare(model_name="tiny-art", directory=changed, revision="r3")
    stale = type(stale)(directory=stale.directory, revision="r1", files=stale.files)
    with pytest.raises(InvalidInput, match="already published with other content"):
        model_publish(model=art_model, publication=stale)

    assert list(ModelFile.objects.order_by("id").values()) == rows_before
    assert (store_root / "tiny-art" / "r1" / "model.safetensors").read_bytes() == WEIGHTS
    assert Model.objects.get(pk=art_model.pk).revision == "r2"
    assert AuditEvent.objects.count() == audits_before


def test_a_conflicting_publication_recorded_during_the_upload_is_refused(
    store_root, art_model, model_directory, tmp_path
):
    """Two publications of one revision race: the one recorded second is refused when it records."""
    rival = write_model_directory(tmp_path / "rival", weights=b"rival weights")

    class RacingStore(LocalArtifactStore):
        def put(self, key: str, source: Path) -> None:
            if not ModelFile.objects.exists():
                publish(art_model, rival, revision="r1")
            super().put(key, source)

    publication = publication_prepare(model_name="tiny-art", directory=model_directory, revision="r1")
    with pytest.raises(InvalidInput, match="already published with other content"):
        model_publish(model=art_model, publication=publication, store=RacingStore(root=store_root))
    assert recorded_files(art_model, "r1") == expected_files(rival)
    assert AuditEvent.objects.filter(action="model.publish").count() == 1
    # The store holds the recorded bytes, and nothing of the refused publication (no staged file either).
    assert stored_files(store_root) == {f"tiny-art/r1/{path}": (rival / path).read_bytes() for path in MODEL_PATHS}


def test_same_revision_with_the_same_content_uploads_nothing_and_becomes_current_again(
    store_root, art_model, model_directory, tmp_path
):
    first = publish(art_model, model_directory)
    publish(art_model, write_model_directory(tmp_path / "second", weights=b"other weights"))
    (store_root / "tiny-art" / first.revision / "config.json").unlink()  # an upload would put it back

    again = publish(art_model, model_directory)

    assert (again.revision, again.uploaded) == (first.revision, False)
    assert not (store_root / "tiny-art" / first.revision / "config.json").exists()
    assert ModelFile.objects.filter(model=art_model).count() == 6
    assert Model.objects.get(pk=art_model.pk).revision == first.revision


@pytest.mark.parametrize("revision", ["../escape", "a/b", ".hidden", "-x", "x" * 65, "spaced out"])
def test_a_malformed_revision_is_refused(store_root, art_model, model_directory, revision):
    with pytest.raises(InvalidInput, match="is not allowed"):
        publish(art_model, model_directory, revision=revision)
    assert not ModelFile.objects.exists()
    assert not store_root.exists()


def test_a_directory_without_files_is_refused(store_root, art_model, tmp_path):
    (tmp_path / "empty" / ".git").mkdir(parents=True)
    (tmp_path / "empty" / ".git" / "config").write_text("x")
    with pytest.raises(InvalidInput, match="holds no files"):
        publication_prepare(model_name="tiny-art", directory=tmp_path / "empty")
    with pytest.raises(InvalidInput, match="is not a directory"):
        publication_prepare(model_name="tiny-art", directory=tmp_path / "missing")


# ---- the manifest ---------------------------------------------------------------------------------------


def test_manifest_of_a_published_model(store_root, art_model, model_directory, art_client):
    revision = publish(art_model, model_directory).revision
    response = art_client.get(MANIFEST_URL)
    assert response.status_code == 200
    files = expected_files(model_directory)
    assert response.json() == {
        "model": "tiny-art",
        "revision": revision,
        "source": "artifacts",
        "files": [{"path": path, "size": size, "sha256": sha256} for path, (size, sha256) in sorted(files.items())],
        "store": {"kind": "control-plane", "url": f"{FILES_URL}/tiny-art/{revision}/"},
    }


def test_manifest_of_a_builtin_model_has_no_files(store_root, prefill_client):
    assert prefill_client.get(MANIFEST_URL).json() == {
        "model": "diptych-tiny",
        "revision": "",
        "source": "builtin:diptych-tiny",
        "files": [],
        "store": None,
    }


def test_manifest_follows_the_current_revision(store_root, art_model, model_directory, art_client, tmp_path):
    publish(art_model, model_directory, revision="r1")
    publish(art_model, write_model_directory(tmp_path / "second", weights=b"second"), revision="r2")
    manifest = art_client.get(MANIFEST_URL).json()
    assert manifest["revision"] == "r2"
    weights = next(entry for entry in manifest["files"] if entry["path"] == "model.safetensors")
    assert weights == {"path": "model.safetensors", "size": 6, "sha256": hashlib.sha256(b"second").hexdigest()}


# ---- the files ------------------------------------------------------------------------------------------


def streamed(response) -> bytes:
    return b"".join(response.streaming_content)


def test_file_endpoint_streams_the_exact_bytes(store_root, art_model, model_directory, art_client):
    revision = publish(art_model, model_directory).revision
    for path, (size, sha256) in expected_files(model_directory).items():
        response = art_client.get(f"{FILES_URL}/tiny-art/{revision}/{path}")
        assert response.status_code == 200
        assert response["Content-Type"] == "application/octet-stream"
        assert (response["Content-Length"], response["X-Content-SHA256"]) == (str(size), sha256)
        assert streamed(response) == (model_directory / path).read_bytes()


def test_file_endpoint_serves_a_client_that_accepts_only_bytes(store_root, art_model, model_directory, art_client):
    publish(art_model, model_directory, revision="r1")
    response = art_client.get(f"{FILES_URL}/tiny-art/r1/config.json", HTTP_ACCEPT="application/octet-stream")
    assert streamed(response) == (model_directory / "config.json").read_bytes()
    missing = art_client.get(f"{FILES_URL}/tiny-art/r9/config.json", HTTP_ACCEPT="application/octet-stream")
    assert (missing.status_code, missing.json()["error"]["type"]) == (404, "not_found")


def test_file_endpoint_refuses_another_models_files(store_root, art_model, model_directory, art_client, tmp_path):
    revision = publish(art_model, model_directory, revision="r1").revision
    other = model_ensure(name="other", source="x", context_length=512, family="llama", dtype="float32")
    publish(other, write_model_directory(tmp_path / "other", weights=b"secret weights"), revision="o1")
    other_client = bearer_client(make_fleet(other, FleetRole.DECODE, "other-decode").token)
    assert streamed(other_client.get(f"{FILES_URL}/other/o1/model.safetensors")) == b"secret weights"

    for url in [
        f"{FILES_URL}/other/o1/model.safetensors",
        f"{FILES_URL}/other/{revision}/model.safetensors",
        f"{FILES_URL}/tiny-art/o1/model.safetensors",
    ]:
        response = art_client.get(url)
        assert response.status_code == 404, url
        assert response.json()["error"]["type"] == "not_found"


@pytest.mark.parametrize(
    "path",
    [
        "../../other/o1/model.safetensors",
        "%2e%2e/%2e%2e/other/o1/model.safetensors",
        "tokenizer/../config.json",
        "./config.json",
        "/config.json",
        "tokenizer",
        ".DS_Store",
    ],
)
def test_file_endpoint_refuses_traversal_and_unpublished_paths(
    store_root, art_model, model_directory, art_client, tmp_path, path
):
    publish(art_model, model_directory, revision="r1")
    other = model_ensure(name="other", source="x", context_length=512, family="llama", dtype="float32")
    publish(other, write_model_directory(tmp_path / "other", weights=b"secret weights"), revision="o1")
    (store_root / "tiny-art" / "r1" / ".DS_Store").write_bytes(b"in the store, but never published")
    response = art_client.get(f"{FILES_URL}/tiny-art/r1/{path}")
    assert response.status_code == 404
    assert b"secret" not in response.content


def test_file_endpoint_unknown_revision_or_file(store_root, art_model, model_directory, art_client):
    publish(art_model, model_directory, revision="r1")
    assert art_client.get(f"{FILES_URL}/tiny-art/r2/config.json").status_code == 404
    assert art_client.get(f"{FILES_URL}/tiny-art/r1/missing.bin").status_code == 404
    (store_root / "tiny-art" / "r1" / "config.json").unlink()
    response = art_client.get(f"{FILES_URL}/tiny-art/r1/config.json")
    assert response.status_code == 404
    assert "missing from the artifact store" in response.json()["error"]["message"]


@pytest.mark.parametrize("url", [MANIFEST_URL, f"{FILES_URL}/tiny-art/r1/config.json"])
def test_artifact_endpoints_refuse_missing_and_wrong_tokens(
    store_root, art_model, model_directory, internal_client, client_a, url
):
    publish(art_model, model_directory, revision="r1")
    wrong_fleet_token = "dft_" + "0" * 38
    for client in [APIClient(), bearer_client("nope"), bearer_client(wrong_fleet_token), internal_client, client_a]:
        response = client.get(url)
        assert response.status_code == 401
        assert b"tokenizer" not in response.content and b"max_position" not in response.content


# ---- the gateway's view (it loads the tokenizer of every model) ------------------------------------------

GATEWAY_MODELS_URL = "/api/v1/internal/artifacts/models"


def test_gateway_reads_any_models_manifest_and_files_with_the_internal_token(
    store_root, art_model, model_directory, internal_client
):
    revision = publish(art_model, model_directory).revision
    manifest = internal_client.get(f"{GATEWAY_MODELS_URL}/tiny-art/manifest").json()
    assert (manifest["revision"], manifest["source"], len(manifest["files"])) == (revision, "artifacts", 3)
    assert manifest["store"] == {"kind": "control-plane", "url": f"{GATEWAY_MODELS_URL}/tiny-art/files/{revision}/"}
    response = internal_client.get(f"{manifest['store']['url']}tokenizer/tokenizer.json")
    assert streamed(response) == (model_directory / "tokenizer" / "tokenizer.json").read_bytes()


def test_gateway_artifact_endpoints_refuse_unknown_models_paths_and_other_tokens(
    store_root, art_model, model_directory, internal_client, art_client
):
    publish(art_model, model_directory, revision="r1")
    assert internal_client.get(f"{GATEWAY_MODELS_URL}/nope/manifest").status_code == 404
    for path in ["../../other/files/r1/config.json", "missing.bin", "tokenizer/../config.json"]:
        assert internal_client.get(f"{GATEWAY_MODELS_URL}/tiny-art/files/r1/{path}").status_code == 404
    assert internal_client.get(f"{GATEWAY_MODELS_URL}/tiny-art/files/r2/config.json").status_code == 404
    for client in [APIClient(), art_client]:
        assert client.get(f"{GATEWAY_MODELS_URL}/tiny-art/manifest").status_code == 401
        assert client.get(f"{GATEWAY_MODELS_URL}/tiny-art/files/r1/config.json").status_code == 401


# ---- the workers' revision ------------------------------------------------------------------------------


def test_registration_keeps_the_workers_revision_and_the_registry_lists_it(
    store_root, art_model, model_directory, art_client, internal_client, prefill_client
):
    publish(art_model, model_directory, revision="r1")
    response = art_client.post(REGISTER_URL, {"address": "127.0.0.1:50061", "name": "p0", "revision": "r1"})
    assert response.status_code == 201
    assert prefill_client.post(REGISTER_URL, {"address": "127.0.0.1:50062", "name": "b0"}).status_code == 201
    registry = internal_client.get(REGISTRY_URL).json()
    assert {worker["name"]: worker["revision"] for worker in registry["workers"]} == {"p0": "r1", "b0": ""}


@pytest.mark.parametrize("revision", ["r9", "x" * 65])
def test_registration_refuses_a_revision_that_was_never_published(
    store_root, art_model, model_directory, art_client, revision
):
    publish(art_model, model_directory, revision="r1")
    response = art_client.post(REGISTER_URL, {"address": "127.0.0.1:50061", "name": "p0", "revision": revision})
    assert response.status_code == 400
    assert "revision" in response.json()["error"]["fields"]
    assert not Worker.objects.exists()


# ---- the S3-compatible store ----------------------------------------------------------------------------

S3_BUCKET = "diptych-artifacts"
MOTO_START_SECONDS = 30


def _free_loopback_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


@pytest.fixture(scope="module")
def moto_endpoint(tmp_path_factory):
    port = _free_loopback_port()
    log = (tmp_path_factory.mktemp("moto") / "moto.log").open("wb")
    server = subprocess.Popen(
        [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)], stdout=log, stderr=log
    )
    try:
        deadline = time.monotonic() + MOTO_START_SECONDS
        while True:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                break
            except OSError:
                if server.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"moto's server did not start on port {port}") from None
                time.sleep(0.1)
        yield f"http://127.0.0.1:{port}"
    finally:
        server.terminate()
        try:
            server.wait(timeout=10)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait(timeout=10)
        log.close()


@pytest.fixture
def s3(moto_endpoint, monkeypatch, settings):
    import boto3

    for name, value in [("AWS_ACCESS_KEY_ID", "test"), ("AWS_SECRET_ACCESS_KEY", "test")]:
        monkeypatch.setenv(name, value)
    monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")
    for name in ["AWS_PROFILE", "AWS_SESSION_TOKEN", "AWS_ENDPOINT_URL"]:
        monkeypatch.delenv(name, raising=False)
    settings.DIPTYCH_ARTIFACT_STORE = f"s3://{S3_BUCKET}/models/"
    settings.DIPTYCH_ARTIFACT_S3_ENDPOINT = moto_endpoint
    client = boto3.client("s3", endpoint_url=moto_endpoint)
    client.create_bucket(Bucket=S3_BUCKET)
    yield client
    for listed in client.list_objects_v2(Bucket=S3_BUCKET).get("Contents", []):
        client.delete_object(Bucket=S3_BUCKET, Key=listed["Key"])
    client.delete_bucket(Bucket=S3_BUCKET)


def s3_objects(client) -> dict[str, bytes]:
    listed = client.list_objects_v2(Bucket=S3_BUCKET).get("Contents", [])
    return {item["Key"]: client.get_object(Bucket=S3_BUCKET, Key=item["Key"])["Body"].read() for item in listed}


def test_s3_publish_uploads_every_file_under_prefix_model_revision_path(
    s3, moto_endpoint, art_model, model_directory, art_client
):
    revision = publish(art_model, model_directory).revision
    assert s3_objects(s3) == {
        f"models/tiny-art/{revision}/{path}": (model_directory / path).read_bytes()
        for path in expected_files(model_directory)
    }
    manifest = art_client.get(MANIFEST_URL).json()
    assert manifest["store"] == {
        "kind": "s3",
        "bucket": S3_BUCKET,
        "prefix": f"models/tiny-art/{revision}/",
        "endpoint_url": moto_endpoint,
    }
    # The control plane streams the same bytes from S3 to a worker that asks it.
    response = art_client.get(f"{FILES_URL}/tiny-art/{revision}/model.safetensors")
    assert streamed(response) == WEIGHTS


def test_s3_refused_republish_uploads_nothing(s3, art_model, model_directory, tmp_path):
    publish(art_model, model_directory, revision="r1")
    before = s3_objects(s3)
    changed = write_model_directory(tmp_path / "changed", weights=b"other weights")
    with pytest.raises(InvalidInput, match="already published with other content"):
        publish(art_model, changed, revision="r1")
    assert s3_objects(s3) == before


def test_s3_a_publication_refused_after_its_upload_leaves_nothing_in_the_bucket(
    s3, moto_endpoint, art_model, model_directory, tmp_path
):
    """As with the local store: a rival records the revision while this publication uploads; the bucket then
    holds the rival's bytes under the revision, and nothing staged."""
    rival = write_model_directory(tmp_path / "rival", weights=b"rival weights")

    class RacingS3Store(S3ArtifactStore):
        def put(self, key: str, source: Path) -> None:
            if not ModelFile.objects.exists():
                publish(art_model, rival, revision="r1")
            super().put(key, source)

    store = RacingS3Store(bucket=S3_BUCKET, prefix="models/", endpoint_url=moto_endpoint)
    publication = publication_prepare(model_name="tiny-art", directory=model_directory, revision="r1")
    with pytest.raises(InvalidInput, match="already published with other content"):
        model_publish(model=art_model, publication=publication, store=store)
    assert s3_objects(s3) == {f"models/tiny-art/r1/{path}": (rival / path).read_bytes() for path in MODEL_PATHS}


def test_s3_store_without_a_prefix(s3, settings, art_model, model_directory):
    settings.DIPTYCH_ARTIFACT_STORE = f"s3://{S3_BUCKET}"
    revision = publish(art_model, model_directory).revision
    assert f"tiny-art/{revision}/config.json" in s3_objects(s3)


def test_local_store_refuses_keys_that_leave_its_root(tmp_path):
    store = LocalArtifactStore(root=tmp_path / "store")
    (tmp_path / "outside.txt").write_text("outside")
    assert not store.exists("../outside.txt")
    with pytest.raises(LookupError):
        store.open("../outside.txt")


# ---- the public catalog ---------------------------------------------------------------------------------


def test_public_catalog_shows_the_revision_and_its_files(store_root, art_model, model_directory, client_a):
    revision = publish(art_model, model_directory).revision
    listed = {model["name"]: model for model in client_a.get("/api/v1/models").json()["data"]}
    assert (listed["tiny-art"]["source"], listed["tiny-art"]["revision"]) == ("artifacts", revision)
    detail = client_a.get("/api/v1/models/tiny-art").json()
    files = expected_files(model_directory)
    assert detail["revision"] == revision
    assert detail["files"] == [{"path": p, "size": size, "sha256": sha} for p, (size, sha) in sorted(files.items())]


def test_public_catalog_of_a_builtin_model_has_no_revision(client_a, tiny_model):
    detail = client_a.get("/api/v1/models/diptych-tiny").json()
    assert (detail["revision"], detail["files"]) == ("", [])
