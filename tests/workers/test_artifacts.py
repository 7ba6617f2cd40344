"""The worker's artifact cache against a real S3-compatible store (moto's server on loopback): files land
verified under `<cache>/<model>/<revision>/<path>`, never under their real name before they are verified,
and any file whose bytes differ from the manifest's sha256, downloaded or cached, is deleted and refused."""

import hashlib
import logging
import os
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import boto3
import pytest

from diptych_common import artifacts
from diptych_common.artifacts import (
    ArtifactCache,
    ArtifactError,
    ArtifactFile,
    ChecksumMismatch,
    Manifest,
    S3Fetcher,
    S3Store,
    model_for_worker,
    parse_manifest,
)

BUCKET = "models"
MODEL, REVISION = "tiny-art", "r1"
PREFIX = f"published/{MODEL}/{REVISION}/"
FILES = {
    "config.json": b'{"model_type": "llama"}\n',
    "tokenizer/vocab.txt": b"a\nb\nc\n",
    "model.safetensors": os.urandom(3 * (1 << 20) + 123),  # several download chunks
}


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


@pytest.fixture(autouse=True)
def aws_credentials(monkeypatch):
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "testing")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "testing")
    monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")


@pytest.fixture(scope="module")
def s3_endpoint():
    port = free_port()
    moto = Path(sys.executable).with_name("moto_server")
    process = subprocess.Popen(
        [str(moto), "-H", "127.0.0.1", "-p", str(port)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=0.5).close()
                break
            except OSError:
                assert process.poll() is None and time.monotonic() < deadline, "moto's server did not start"
                time.sleep(0.1)
        yield f"http://127.0.0.1:{port}"
    finally:
        process.terminate()
        process.wait(10)


@pytest.fixture
def store(s3_endpoint, aws_credentials):
    """A fresh bucket holding FILES as one published revision."""
    s3 = boto3.client("s3", endpoint_url=s3_endpoint)
    s3.create_bucket(Bucket=BUCKET)
    for path, data in FILES.items():
        s3.put_object(Bucket=BUCKET, Key=PREFIX + path, Body=data)
    yield s3
    for item in s3.list_objects_v2(Bucket=BUCKET).get("Contents", []):
        s3.delete_object(Bucket=BUCKET, Key=item["Key"])
    s3.delete_bucket(Bucket=BUCKET)
    s3.close()


def manifest_of(s3_endpoint: str, files: dict[str, bytes] = FILES) -> Manifest:
    entries = tuple(ArtifactFile(path, len(data), hashlib.sha256(data).hexdigest()) for path, data in files.items())
    return Manifest(MODEL, REVISION, "artifacts", entries, S3Store(BUCKET, PREFIX, s3_endpoint))


def ensure(cache: ArtifactCache, manifest: Manifest) -> Path:
    assert isinstance(manifest.store, S3Store)
    fetcher = S3Fetcher(manifest.store)
    try:
        return cache.ensure(manifest, fetcher)
    finally:
        fetcher.close()


def leftovers(directory: Path) -> list[str]:
    return sorted(str(p.relative_to(directory)) for p in directory.rglob("*") if p.is_file() and p.name.startswith("."))


def test_files_are_fetched_into_the_cache_layout_with_their_exact_bytes(store, s3_endpoint, tmp_path):
    directory = ensure(ArtifactCache(tmp_path), manifest_of(s3_endpoint))
    assert directory == tmp_path / MODEL / REVISION
    assert {str(p.relative_to(directory)): p.read_bytes() for p in directory.rglob("*") if p.is_file()} == FILES


def test_a_verified_cache_is_used_without_the_store(store, s3_endpoint, tmp_path):
    cache = ArtifactCache(tmp_path)
    ensure(cache, manifest_of(s3_endpoint))
    for path in FILES:
        store.delete_object(Bucket=BUCKET, Key=PREFIX + path)
    assert (ensure(cache, manifest_of(s3_endpoint)) / "model.safetensors").read_bytes() == FILES["model.safetensors"]


def test_a_store_file_with_other_bytes_is_refused_naming_both_digests_and_not_kept(store, s3_endpoint, tmp_path):
    tampered = bytearray(FILES["model.safetensors"])
    tampered[1000] ^= 0x01
    store.put_object(Bucket=BUCKET, Key=PREFIX + "model.safetensors", Body=bytes(tampered))
    with pytest.raises(ChecksumMismatch) as refused:
        ensure(ArtifactCache(tmp_path), manifest_of(s3_endpoint))
    expected = hashlib.sha256(FILES["model.safetensors"]).hexdigest()
    actual = hashlib.sha256(tampered).hexdigest()
    assert str(refused.value).startswith(
        f"checksum mismatch for model.safetensors (as downloaded; not kept): expected sha256 {expected}, got {actual}"
    )
    directory = tmp_path / MODEL / REVISION
    assert not (directory / "model.safetensors").exists()
    assert leftovers(directory) == []


def test_a_tampered_cache_file_of_the_same_size_is_deleted_and_refused_then_fetched_again(store, s3_endpoint, tmp_path):
    cache = ArtifactCache(tmp_path)
    directory = ensure(cache, manifest_of(s3_endpoint))
    weights = directory / "model.safetensors"
    corrupted = bytearray(weights.read_bytes())
    corrupted[-1] ^= 0x80
    weights.write_bytes(bytes(corrupted))
    with pytest.raises(ChecksumMismatch) as refused:
        ensure(cache, manifest_of(s3_endpoint))
    assert f"in the cache at {weights}; deleted it" in str(refused.value)
    assert hashlib.sha256(corrupted).hexdigest() in str(refused.value)
    assert not weights.exists()
    ensure(cache, manifest_of(s3_endpoint))  # the next start fetches it anew
    assert weights.read_bytes() == FILES["model.safetensors"]


class WatchingFetcher:
    """An S3 fetcher that notes, at every chunk it writes, whether the file's real name exists yet."""

    def __init__(self, inner: S3Fetcher, target: Path):
        self.inner, self.target, self.seen = inner, target, []

    def fetch(self, file, sink, progress):
        def watch(count: int) -> None:
            if file.path == self.target.name:
                self.seen.append(self.target.exists())
            progress(count)

        self.inner.fetch(file, sink, watch)

    def close(self):
        self.inner.close()


def test_a_file_being_downloaded_never_appears_under_its_real_name(store, s3_endpoint, tmp_path):
    manifest = manifest_of(s3_endpoint)
    assert isinstance(manifest.store, S3Store)
    target = tmp_path / MODEL / REVISION / "model.safetensors"
    fetcher = WatchingFetcher(S3Fetcher(manifest.store), target)
    ArtifactCache(tmp_path).ensure(manifest, fetcher)
    fetcher.close()
    assert len(fetcher.seen) >= 3 and not any(fetcher.seen), fetcher.seen
    assert target.read_bytes() == FILES["model.safetensors"]


def test_a_store_sending_more_than_the_listed_size_is_cut_off_and_nothing_is_kept(store, s3_endpoint, tmp_path):
    store.put_object(Bucket=BUCKET, Key=PREFIX + "config.json", Body=FILES["config.json"] * 4)
    with pytest.raises(ArtifactError, match=r"more than the 24 bytes the manifest lists for config.json"):
        ensure(ArtifactCache(tmp_path), manifest_of(s3_endpoint))
    directory = tmp_path / MODEL / REVISION
    assert not (directory / "config.json").exists() and leftovers(directory) == []


def test_a_missing_store_file_is_an_error_naming_its_key(store, s3_endpoint, tmp_path):
    store.delete_object(Bucket=BUCKET, Key=PREFIX + "tokenizer/vocab.txt")
    with pytest.raises(ArtifactError, match=f"s3://{BUCKET}/{PREFIX}tokenizer/vocab.txt"):
        ensure(ArtifactCache(tmp_path), manifest_of(s3_endpoint))


def test_a_big_file_logs_its_progress_in_bytes(store, s3_endpoint, tmp_path, monkeypatch, caplog):
    monkeypatch.setattr(artifacts, "BIG_FILE_BYTES", 1 << 20)
    monkeypatch.setattr(artifacts, "PROGRESS_EVERY_S", 0.0)
    with caplog.at_level(logging.INFO, logger="diptych_common.artifacts"):
        ensure(ArtifactCache(tmp_path), manifest_of(s3_endpoint))
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("fetching model.safetensors")]
    assert lines[0] == "fetching model.safetensors: 3.0 MiB"
    assert "fetching model.safetensors: 1.0 MiB of 3.0 MiB" in lines
    assert not any(r.getMessage().startswith("fetching config.json") for r in caplog.records)


def test_partial_files_of_dead_downloads_are_swept(store, s3_endpoint, tmp_path):
    directory = tmp_path / MODEL / REVISION
    directory.mkdir(parents=True)
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    stale = directory / f".config.json.{dead.stdout.strip()}-abcd1234.partial"
    mine = directory / f".config.json.{os.getpid()}-abcd1234.partial"
    stale.write_bytes(b"half")
    mine.write_bytes(b"half")
    ensure(ArtifactCache(tmp_path), manifest_of(s3_endpoint))
    assert not stale.exists() and mine.exists()


@pytest.mark.parametrize(
    ("path", "message"),
    [
        ("../escape.bin", "outside the model directory"),
        ("/etc/passwd", "outside the model directory"),
        ("a/./b", "outside the model directory"),
        (".secret", "dot-file"),
    ],
)
def test_a_manifest_naming_a_file_outside_the_model_directory_is_refused(path, message):
    body = {
        "model": MODEL,
        "revision": REVISION,
        "source": "artifacts",
        "files": [{"path": path, "size": 1, "sha256": "0" * 64}],
        "store": {"kind": "control-plane", "url": "/api/v1/internal/artifacts/files/tiny-art/r1/"},
    }
    with pytest.raises(ArtifactError, match=message):
        parse_manifest(body)


def test_a_manifest_with_a_malformed_digest_or_store_is_refused():
    body = {"model": MODEL, "revision": REVISION, "source": "artifacts"}
    with pytest.raises(ArtifactError, match="no valid sha256"):
        parse_manifest(
            body
            | {
                "files": [{"path": "config.json", "size": 1, "sha256": "abc"}],
                "store": {"kind": "s3", "bucket": "b", "prefix": "p/"},
            }
        )
    with pytest.raises(ArtifactError, match="unknown store kind 'ftp'"):
        parse_manifest(
            body | {"files": [{"path": "config.json", "size": 1, "sha256": "0" * 64}], "store": {"kind": "ftp"}}
        )


def test_a_model_not_published_as_artifacts_keeps_its_catalog_source():
    manifest = parse_manifest({"model": "diptych-tiny", "revision": "", "source": "builtin:diptych-tiny", "files": []})
    assert manifest == Manifest("diptych-tiny", "", "builtin:diptych-tiny")


def test_an_explicit_model_source_needs_no_control_plane(tmp_path):
    unreachable = f"http://127.0.0.1:{free_port()}"  # nothing listens: asking it would wait for ever
    resolved = []
    cache = ArtifactCache(tmp_path)
    asking = threading.Thread(
        target=lambda: resolved.append(
            model_for_worker("", "builtin:diptych-tiny", unreachable, "dft_x", cache, "diptych-tiny")
        ),
        daemon=True,
    )
    asking.start()
    asking.join(10)
    assert resolved, "the worker waited for a control plane it does not need"
    assert (resolved[0].model, resolved[0].source, resolved[0].revision) == ("diptych-tiny", "builtin:diptych-tiny", "")
    assert not any(tmp_path.iterdir())
