"""Where the files of published model revisions are kept, under the key `<model>/<revision>/<path>`.

A publication uploads its files to a staging folder of its own first (`.staging-<random>/<path>`, a name no
model has) and moves them to their revision's keys only once the catalog accepts it; a refused publication's
staged files are deleted, so nothing it sent ever sits under a revision's keys.

The embedded default is a local directory that the control plane serves to workers; production uses an
S3-compatible bucket (DIPTYCH_ARTIFACT_STORE=s3://BUCKET/PREFIX) that workers read directly.
"""

import os
import secrets
import shutil
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Any, Protocol

from django.conf import settings
from django.core.exceptions import ImproperlyConfigured
from typing_extensions import override

CHUNK_BYTES = 1 << 20


class ArtifactNotFound(LookupError):
    pass


def staging_folder() -> str:
    """A fresh folder for one publication's uploads, outside every model's keys (a model name starts with a
    letter or digit)."""
    return f".staging-{secrets.token_hex(16)}"


def artifact_key(*, model: str, revision: str, path: str) -> str:
    """The store key of one file; refuses a path that could leave the revision's folder."""
    relative = PurePosixPath(path)
    if not path or relative.is_absolute() or any(part in {"", ".", ".."} for part in path.split("/")):
        raise ValueError(f"Artifact path {path!r} must be relative, without '.' or '..' components.")
    return f"{model}/{revision}/{relative}"


class ArtifactStore(Protocol):
    def put(self, key: str, source: Path) -> None: ...

    def move(self, source_key: str, key: str) -> None:
        """Puts what is stored under `source_key` under `key` (replacing what was there) and deletes the source."""
        ...

    def delete_folder(self, folder: str) -> None:
        """Deletes every key under `folder/`; nothing there is no error."""
        ...

    def open(self, key: str) -> Iterator[bytes]: ...

    def exists(self, key: str) -> bool: ...

    def describe(self, *, model: str, revision: str, served_at: str) -> dict[str, Any]:
        """Where a reader finds the revision's files; `served_at` is the control plane's URL of them."""
        ...


@dataclass(frozen=True)
class LocalArtifactStore(ArtifactStore):
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

    def move(self, source_key: str, key: str) -> None:
        target = self._path(key)
        target.parent.mkdir(parents=True, exist_ok=True)
        os.replace(self._path(source_key), target)

    def delete_folder(self, folder: str) -> None:
        shutil.rmtree(self._path(folder), ignore_errors=True)

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

    @override
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
class S3ArtifactStore(ArtifactStore):
    bucket: str
    prefix: str  # "" or ending in "/"
    endpoint_url: str  # "" for AWS itself

    def put(self, key: str, source: Path) -> None:
        self._client().upload_file(str(source), self.bucket, self.prefix + key)

    def move(self, source_key: str, key: str) -> None:
        client = self._client()
        # S3 renames nothing: a server-side copy (multipart for a large object), then the source is deleted.
        client.copy({"Bucket": self.bucket, "Key": self.prefix + source_key}, self.bucket, self.prefix + key)
        client.delete_object(Bucket=self.bucket, Key=self.prefix + source_key)

    def delete_folder(self, folder: str) -> None:
        client = self._client()
        pages = client.get_paginator("list_objects_v2").paginate(Bucket=self.bucket, Prefix=f"{self.prefix}{folder}/")
        for page in pages:
            keys = [{"Key": listed["Key"]} for listed in page.get("Contents", [])]
            if keys:  # a page lists at most 1000 keys, as many as one delete_objects takes
                client.delete_objects(Bucket=self.bucket, Delete={"Objects": keys, "Quiet": True})

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

    @override
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
