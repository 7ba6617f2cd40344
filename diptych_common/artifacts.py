"""Model artifacts, for workers (and the gateway's tokenizers): the manifest (a model's current revision and
files), the stores the files come from (the control plane itself, or S3-compatible storage) and the local
cache. It imports no torch and no Django: the gateway and the workers both use it.

A file is downloaded under a temporary name, its sha256 checked, and only then renamed into place, so the
cache never holds a partly written file under a real name. A file already in the cache is checked again
before use. Any mismatch deletes the bad file and stops the worker: a store or disk that hands out other
bytes than the catalog recorded is a fault to look at, not to serve around (the next start fetches anew).
"""

import hashlib
import logging
import os
import re
import secrets
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, BinaryIO, Protocol
from urllib.parse import quote

import httpx

from diptych_common.internal_api.client import ControlPlaneUnavailable, SyncControlPlaneClient, describe_failure
from diptych_common.internal_api.endpoints import MODEL_ARTIFACT_FILE
from diptych_common.logs import describe_error
from diptych_common.processes import process_alive

log = logging.getLogger(__name__)

WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".gguf", ".h5", ".msgpack")
ARTIFACTS_SOURCE = "artifacts"
DEFAULT_CACHE = Path("~/.cache/diptych/artifacts")
CHUNK_BYTES = 1 << 20
PROGRESS_EVERY_S = 2.0  # how often a big file's download logs its bytes done
BIG_FILE_BYTES = 64 << 20  # files at least this big log their progress while they download
FETCH_ATTEMPTS = 3  # a broken connection is tried again; a wrong digest never is
RETRY_DELAY_S = 1.0
SHA256 = re.compile(r"[0-9a-f]{64}")
NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*")
PARTIAL_SUFFIX = ".partial"


class ArtifactError(Exception):
    """The worker cannot get its model's files; it refuses to start."""


class ChecksumMismatch(ArtifactError):
    def __init__(self, path: str, expected: str, actual: str, where: str) -> None:
        super().__init__(f"checksum mismatch for {path} ({where}): expected sha256 {expected}, got {actual}")
        self.path, self.expected, self.actual = path, expected, actual


@dataclass(frozen=True)
class ArtifactFile:
    path: str  # relative POSIX path inside the model directory
    size: int
    sha256: str


@dataclass(frozen=True)
class ControlPlaneStore:
    url: str  # the files' URL prefix on the control plane: a file's URL is this and its path


@dataclass(frozen=True)
class S3Store:
    bucket: str
    prefix: str  # the key prefix of this revision's files, ending in '/'
    endpoint_url: str  # empty: AWS


@dataclass(frozen=True)
class Manifest:
    model: str
    revision: str  # "" for a model not published as artifacts
    source: str  # "artifacts", "builtin:<name>" or a local directory
    files: tuple[ArtifactFile, ...] = ()
    store: ControlPlaneStore | S3Store | None = None


def fetch_manifest(
    control_plane_url: str, token: str, model: str = "", timeout_s: float = 10.0, wait: bool = True
) -> Manifest:
    """The current revision of `model` (with the internal token), by default of the calling fleet's model
    (with its fleet token). With `wait`, waits while the control plane is unreachable or failing (as
    registration does); a refused token or a malformed answer is an ArtifactError at once."""
    with SyncControlPlaneClient(control_plane_url, token, timeout=timeout_s) as control_plane:
        while True:
            try:
                body = control_plane.model_artifact_manifest(model) if model else control_plane.artifact_manifest()
                return parse_manifest(body)
            except ControlPlaneUnavailable as error:
                if not wait:
                    raise ArtifactError(f"cannot reach the control plane: {describe_failure(error)}") from error
                log.warning(
                    "cannot reach the control plane for the model manifest (%s); retrying", describe_failure(error)
                )
            except httpx.HTTPStatusError as error:
                raise ArtifactError(_refusal(error.response)) from None
            time.sleep(RETRY_DELAY_S)


def _refusal(response: httpx.Response) -> str:
    if response.status_code in (401, 403):
        return f"the control plane refused the token for the model manifest: {response.text}"
    return f"the control plane answered {response.status_code} for the model manifest: {response.text}"


def parse_manifest(body: dict[str, Any]) -> Manifest:
    """The manifest in `body`, checked: names that cannot leave the cache, well-formed digests and sizes."""
    try:
        model, revision, source = str(body["model"]), str(body["revision"]), str(body["source"])
        if source != ARTIFACTS_SOURCE:
            return Manifest(model, revision, source)
        files = tuple(ArtifactFile(str(f["path"]), int(f["size"]), str(f["sha256"])) for f in body["files"])
        store = _parse_store(body["store"])
    except (KeyError, TypeError, ValueError) as error:
        raise ArtifactError(f"the control plane's model manifest is malformed ({error!r}): {body}") from None
    for name, what in ((model, "model name"), (revision, "revision")):
        if not NAME.fullmatch(name):
            raise ArtifactError(f"the manifest's {what} {name!r} is not a plain name")
    if not files:
        raise ArtifactError(f"the manifest of {model} revision {revision} lists no files")
    for file in files:
        _check_file_entry(file)
    return Manifest(model, revision, source, files, store)


def _parse_store(store: dict[str, Any]) -> ControlPlaneStore | S3Store:
    if store["kind"] == "control-plane":
        return ControlPlaneStore(str(store["url"]))
    if store["kind"] == "s3":
        return S3Store(str(store["bucket"]), str(store["prefix"]), str(store.get("endpoint_url") or ""))
    raise ValueError(f"unknown store kind {store['kind']!r}")


def _check_file_entry(file: ArtifactFile) -> None:
    parts = file.path.split("/")
    if any(part in ("", ".", "..") for part in parts) or "\\" in file.path or "\0" in file.path:
        raise ArtifactError(f"the manifest names a file outside the model directory: {file.path!r}")
    if parts[-1].startswith("."):
        raise ArtifactError(f"the manifest names a dot-file, which publishing never uploads: {file.path!r}")
    if not SHA256.fullmatch(file.sha256) or file.size < 0:
        raise ArtifactError(f"the manifest's entry for {file.path} has no valid sha256 and size: {file}")


class Fetcher(Protocol):
    """Writes one file of the manifest's revision to `sink`, calling `progress` with each chunk's length."""

    def fetch(self, file: ArtifactFile, sink: BinaryIO, progress: Callable[[int], None]) -> None: ...

    def close(self) -> None: ...


class ControlPlaneFetcher:
    """Streams files from the control plane's local store, with the fleet token."""

    def __init__(self, control_plane_url: str, fleet_token: str, store: ControlPlaneStore, timeout_s: float = 30.0):
        self._http = httpx.Client(
            base_url=control_plane_url.rstrip("/"), headers=_bearer(fleet_token), timeout=timeout_s
        )
        self._prefix = store.url if store.url.endswith("/") else store.url + "/"

    def fetch(self, file: ArtifactFile, sink: BinaryIO, progress: Callable[[int], None]) -> None:
        with self._http.stream("GET", self._prefix + quote(file.path)) as response:
            if response.status_code != 200:
                response.read()
                raise ArtifactError(
                    f"the control plane answered {response.status_code} for {file.path}: {response.text[:300]}"
                )
            _copy(response.iter_bytes(CHUNK_BYTES), sink, progress)

    def close(self) -> None:
        self._http.close()


class S3Fetcher:
    """Streams files from an S3-compatible bucket; credentials from the usual AWS environment."""

    def __init__(self, store: S3Store):
        import boto3  # only workers whose models live in S3 pay for importing it

        self._store = store
        self._s3 = boto3.client("s3", endpoint_url=store.endpoint_url or None)

    def fetch(self, file: ArtifactFile, sink: BinaryIO, progress: Callable[[int], None]) -> None:
        from botocore.exceptions import BotoCoreError, ClientError

        key = self._store.prefix + file.path
        try:
            body = self._s3.get_object(Bucket=self._store.bucket, Key=key)["Body"]
            _copy(body.iter_chunks(CHUNK_BYTES), sink, progress)
        except ClientError as error:
            raise ArtifactError(f"S3 refused s3://{self._store.bucket}/{key}: {error}") from None
        except BotoCoreError as error:
            raise ConnectionError(f"S3 failed for s3://{self._store.bucket}/{key}: {error}") from error

    def close(self) -> None:
        self._s3.close()


def _copy(chunks: Iterator[bytes], sink: BinaryIO, progress: Callable[[int], None]) -> None:
    for chunk in chunks:
        sink.write(chunk)
        progress(len(chunk))


def fetcher_for(manifest: Manifest, control_plane_url: str, fleet_token: str) -> Fetcher:
    if isinstance(manifest.store, S3Store):
        return S3Fetcher(manifest.store)
    if isinstance(manifest.store, ControlPlaneStore):
        return ControlPlaneFetcher(control_plane_url, fleet_token, manifest.store)
    raise ArtifactError(f"the manifest of {manifest.model} names no artifact store")


class ArtifactCache:
    """Files laid out `<root>/<model>/<revision>/<path>`; every file checked against its sha256 before use."""

    def __init__(self, root: Path) -> None:
        self.root = root.expanduser()

    def directory(self, manifest: Manifest) -> Path:
        return self.root / manifest.model / manifest.revision

    def ensure(self, manifest: Manifest, fetcher: Fetcher) -> Path:
        """The revision's directory, every file in it present and verified; fetches what is missing."""
        directory = self.directory(manifest)
        fetched = reused = 0
        started = time.monotonic()
        for file in manifest.files:
            target = directory / file.path
            if target.exists():
                self._verify_cached(target, file)
                reused += 1
            else:
                self._download(target, file, fetcher)
                fetched += 1
        log.info(
            "%s revision %s in %s: %d file(s) fetched, %d verified from the cache, in %.1f s",
            manifest.model,
            manifest.revision,
            directory,
            fetched,
            reused,
            time.monotonic() - started,
        )
        return directory

    def _verify_cached(self, target: Path, file: ArtifactFile) -> None:
        actual = sha256_of(target)
        if actual != file.sha256:
            target.unlink(missing_ok=True)
            raise ChecksumMismatch(file.path, file.sha256, actual, f"in the cache at {target}; deleted it")

    def _download(self, target: Path, file: ArtifactFile, fetcher: Fetcher) -> None:
        target.parent.mkdir(parents=True, exist_ok=True)
        _sweep_partials(target.parent)
        for attempt in range(1, FETCH_ATTEMPTS + 1):
            partial = target.with_name(f".{target.name}.{os.getpid()}-{secrets.token_hex(4)}{PARTIAL_SUFFIX}")
            try:
                actual = self._download_to(partial, file, fetcher)
                if actual != file.sha256:
                    raise ChecksumMismatch(file.path, file.sha256, actual, "as downloaded; not kept")
                os.replace(partial, target)
                return
            except (httpx.TransportError, ConnectionError) as error:
                if attempt == FETCH_ATTEMPTS:
                    raise ArtifactError(f"could not download {file.path}: {describe_error(error)}") from error
                log.warning("downloading %s failed (%s); trying again", file.path, describe_error(error))
                time.sleep(RETRY_DELAY_S)
            finally:
                partial.unlink(missing_ok=True)

    def _download_to(self, partial: Path, file: ArtifactFile, fetcher: Fetcher) -> str:
        """Writes the file to `partial` and returns the sha256 of what arrived."""
        digest = hashlib.sha256()
        progress = Progress(file.path, file.size)
        with open(partial, "wb") as raw:
            sink = _HashingWriter(raw, digest, file)
            fetcher.fetch(file, sink, progress.advance)  # type: ignore[arg-type]  # writes only
            raw.flush()
            os.fsync(raw.fileno())
        progress.done()
        if sink.written != file.size:
            raise ChecksumMismatch(
                file.path,
                file.sha256,
                f"{digest.hexdigest()} ({sink.written} bytes, not {file.size})",
                "as downloaded; not kept",
            )
        return digest.hexdigest()


class _HashingWriter:
    """Hashes what it writes, and refuses more bytes than the manifest lists (a store cannot fill the disk)."""

    def __init__(self, raw: BinaryIO, digest: "hashlib._Hash", file: ArtifactFile) -> None:
        self._raw, self._digest, self._file = raw, digest, file
        self.written = 0

    def write(self, chunk: bytes) -> int:
        self.written += len(chunk)
        if self.written > self._file.size:
            raise ArtifactError(
                f"the store sent more than the {self._file.size} bytes the manifest lists for {self._file.path}"
            )
        self._digest.update(chunk)
        return self._raw.write(chunk)


class Progress:
    """Logs a big file's download: bytes done of the total, every PROGRESS_EVERY_S."""

    def __init__(self, path: str, total: int) -> None:
        self._path, self._total = path, total
        self._big = total >= BIG_FILE_BYTES
        self._done = 0
        self._started = self._logged = time.monotonic()
        if self._big:
            log.info("fetching %s: %s", path, _bytes(total))

    def advance(self, count: int) -> None:
        self._done += count
        now = time.monotonic()
        if self._big and now - self._logged >= PROGRESS_EVERY_S:
            self._logged = now
            log.info("fetching %s: %s of %s", self._path, _bytes(self._done), _bytes(self._total))

    def done(self) -> None:
        elapsed = time.monotonic() - self._started
        log.info("fetched %s: %s in %.1f s", self._path, _bytes(self._done), elapsed)


def _bytes(count: int) -> str:
    if count >= 1 << 30:
        return f"{count / (1 << 30):.1f} GiB"
    return f"{count / (1 << 20):.1f} MiB" if count >= 1 << 20 else f"{count} bytes"


def _sweep_partials(directory: Path) -> None:
    """Removes temporary files left by downloads whose process is gone (one that crashed mid-file)."""
    for partial in directory.glob(f".*{PARTIAL_SUFFIX}"):
        pid = partial.name.removesuffix(PARTIAL_SUFFIX).rpartition(".")[2].partition("-")[0]
        if pid.isdigit() and not process_alive(int(pid)):
            partial.unlink(missing_ok=True)


def model_directory_files(directory: Path) -> list[str]:
    """The path of every file under `directory` that publishing takes (dot-files and dot-folders aside), by path."""
    paths = []
    for folder, subfolders, names in os.walk(directory):
        subfolders[:] = [name for name in subfolders if not name.startswith(".")]
        for name in names:
            file = Path(folder, name)
            if not name.startswith(".") and file.is_file():
                paths.append(file.relative_to(directory).as_posix())
    return sorted(paths)


def sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as file:
        while chunk := file.read(CHUNK_BYTES):
            digest.update(chunk)
    return digest.hexdigest()


@dataclass(frozen=True)
class ResolvedModel:
    model: str
    source: str  # what load_model reads: builtin:<name> or a local directory
    revision: str  # "" unless the model came as artifacts


def resolve_model(manifest: Manifest, cache: ArtifactCache, control_plane_url: str, fleet_token: str) -> ResolvedModel:
    """Where to load the fleet's model from: the catalog's builtin or local source as it is, or the
    revision's files, fetched into the cache and verified."""
    if manifest.source != ARTIFACTS_SOURCE:
        return ResolvedModel(manifest.model, manifest.source, "")
    fetcher = fetcher_for(manifest, control_plane_url, fleet_token)
    try:
        directory = cache.ensure(manifest, fetcher)
    finally:
        fetcher.close()
    return ResolvedModel(manifest.model, str(directory), manifest.revision)


def _bearer(token: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


def model_for_worker(
    model: str, model_source: str, control_plane_url: str, fleet_token: str, cache: ArtifactCache, default_model: str
) -> ResolvedModel:
    """What a worker loads. An explicit `model_source` loads as given, without asking the control plane;
    none asks for the fleet's manifest (and `model`, when given, must be the fleet's)."""
    if model_source:
        return ResolvedModel(model or default_model, model_source, "")
    manifest = fetch_manifest(control_plane_url, fleet_token)
    if model and model != manifest.model:
        raise ArtifactError(f"the fleet token belongs to a fleet of {manifest.model}, but this worker is for {model}")
    return resolve_model(manifest, cache, control_plane_url, fleet_token)


def fetch_tokenizer_files(control_plane_url: str, internal_token: str, model: str, cache: ArtifactCache) -> str:
    """For the gateway, which tokenizes but never loads weights: the directory of the model's current
    revision with every file but its weights, fetched and verified as a worker's are."""
    manifest = fetch_manifest(control_plane_url, internal_token, model, wait=False)
    if manifest.source != ARTIFACTS_SOURCE:
        raise ArtifactError(f"{model} is not published as artifacts (its source is {manifest.source!r})")
    files = tuple(f for f in manifest.files if not f.path.endswith(WEIGHT_SUFFIXES))
    # Through the control plane whatever the store: a few small files, and the gateway needs no store credentials.
    # The revision's folder is the URL of a file in it without the file's path.
    store = ControlPlaneStore(MODEL_ARTIFACT_FILE.url(model=model, revision=manifest.revision, path=""))
    tokenizer = replace(manifest, files=files, store=store)
    return resolve_model(tokenizer, cache, control_plane_url, internal_token).source
