"""Where the files of published model revisions are kept, under the key `<model>/<revision>/<path>`.

The embedded default is a local directory that the control plane serves to workers; production uses an
S3-compatible bucket (DIPTYCH_ARTIFACT_STORE=s3://BUCKET/PREFIX) that workers read directly.
"""

import os
import shutil
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Any, Protocol

from django.conf import settings
from django.core.exceptions import ImproperlyConfigured

CHUNK_BYTES = 1 << 20


class ArtifactNotFound(LookupError):
    pass


def artifact_key(*, model: str, revision: str, path: str) -> str:
    """The store key of one file; refuses a path that could leave the revision's folder."""
    relative = PurePosixPath(path)
    if not path or relative.is_absolute() or any(part in {"", ".", ".."} for part in path.split("/")):
        raise ValueError(f"Artifact path {path!r} must be relative, without '.' or '..' components.")
    return f"{model}/{revision}/{relative}"


class ArtifactStore(Protocol):
    def put(self, key: str, source: Path) -> None: ...

    def open(self, key: str) -> Iterator[bytes]: ...

    def exists(self, key: str) -> bool: ...

    def describe(self, *, model: str, revision: str, served_at: str) -> dict[str, Any]:
        """Where a reader finds the revision's files; `served_at` is the control plane's URL of them."""
        ...


@dataclass(frozen=True)
class LocalArtifactStore:
    root: Path

    def put(self, key: str, source: Path) -> None:
        target = self._path(key)
        target.parent.mkdir(parents=True, exist_ok=True)
        # Copied under a temporary name and renamed, so a reader never sees half a file.
        descriptor, temporary = tempfile.mkstemp(dir=target.parent, prefix=f".{target.name}.", suffix=".part")
        try:
            with os.fdopen(descriptor, "wb") as out, source.open("rb") as data:
                shutil.copyfileobj(data, out, CHUNK_BYTES)
            os.replace(temporary, target)
        except BaseException:
            Path(temporary).unlink(missing_ok=True)
            raise

    def open(self, key: str) -> Iterator[bytes]:
        path = self._path(key)
        try:
            handle = path.open("rb")
        except (FileNotFoundError, IsADirectoryError, NotADirectoryError):
            raise ArtifactNotFound(key) from None
        return _chunks(handle)

    def exists(self, key: str) -> bool:
        try:
            return self._path(key).is_file()
        except ArtifactNotFound:
            return False

    def describe(self, *, model: str, revision: str, served_at: str) -> dict[str, Any]:
        return {"kind": "control-plane", "url": served_at}

    def _path(self, key: str) -> Path:
        root = self.root.resolve()
        path = (root / key).resolve()
        if not path.is_relative_to(root):
            raise ArtifactNotFound(key)
        return path


def _chunks(handle) -> Iterator[bytes]:
    with handle:
        while chunk := handle.read(CHUNK_BYTES):
            yield chunk


@dataclass(frozen=True)
class S3ArtifactStore:
    bucket: str
    prefix: str  # "" or ending in "/"
    endpoint_url: str  # "" for AWS itself

    def put(self, key: str, source: Path) -> None:
        self._client().upload_file(str(source), self.bucket, self.prefix + key)

    def open(self, key: str) -> Iterator[bytes]:
        from botocore.exceptions import ClientError

        try:
            body = self._client().get_object(Bucket=self.bucket, Key=self.prefix + key)["Body"]
        except ClientError as error:
            if _is_not_found(error):
                raise ArtifactNotFound(key) from None
            raise
        return _chunks(body)

    def exists(self, key: str) -> bool:
        from botocore.exceptions import ClientError

        try:
            self._client().head_object(Bucket=self.bucket, Key=self.prefix + key)
        except ClientError as error:
            if _is_not_found(error):
                return False
            raise
        return True

    def describe(self, *, model: str, revision: str, served_at: str) -> dict[str, Any]:
        return {
            "kind": "s3",
            "bucket": self.bucket,
            "prefix": f"{self.prefix}{model}/{revision}/",
            "endpoint_url": self.endpoint_url,
        }

    def _client(self):
        import boto3

        # Credentials and region come from the usual AWS_* environment, as for any boto3 client.
        return boto3.client("s3", endpoint_url=self.endpoint_url or None)


def _is_not_found(error) -> bool:
    return error.response.get("Error", {}).get("Code") in {"404", "NoSuchKey", "NotFound"}


def parse_s3_location(location: str) -> tuple[str, str]:
    """`s3://BUCKET/PREFIX` as (bucket, prefix ending in '/' or empty)."""
    bucket, _, prefix = location.removeprefix("s3://").partition("/")
    if not location.startswith("s3://") or not bucket:
        raise ImproperlyConfigured(f"DIPTYCH_ARTIFACT_STORE must be empty or s3://BUCKET/PREFIX, got {location!r}.")
    prefix = prefix.strip("/")
    return bucket, f"{prefix}/" if prefix else ""


def artifact_store() -> ArtifactStore:
    """The store the settings name: DIPTYCH_ARTIFACT_STORE, else the local DIPTYCH_ARTIFACT_DIR."""
    location = settings.DIPTYCH_ARTIFACT_STORE
    if not location:
        return LocalArtifactStore(root=Path(settings.DIPTYCH_ARTIFACT_DIR))
    bucket, prefix = parse_s3_location(location)
    return S3ArtifactStore(bucket=bucket, prefix=prefix, endpoint_url=settings.DIPTYCH_ARTIFACT_S3_ENDPOINT)
