"""The Batch API: `client.files` (JSON Lines input and result files) and `client.batches` (run a file of
requests in the background at batch priority and price), over the control plane's REST API (`admin_url`).

Any key with the inference scope may use them. The asyncio twins run each call in a worker thread.
"""

from __future__ import annotations

import asyncio
import os
import uuid
from pathlib import Path
from typing import IO, TYPE_CHECKING
from urllib.parse import quote

from .._batch_convert import batch_from_json, cursor_page_from_json, file_from_json
from ..types import Batch, CursorPage, FileObject

if TYPE_CHECKING:
    from .._client import AsyncClient, Client

__all__ = ["Files", "AsyncFiles", "Batches", "AsyncBatches", "FileInput"]

# bytes, a path, an open binary file, or (filename, bytes)
FileInput = bytes | str | os.PathLike | IO[bytes] | tuple[str, bytes]


class _Resource:
    def __init__(self, client: Client) -> None:
        self._client = client

    def _request(self, method: str, path: str, **options) -> object:
        client = self._client
        return client._admin_transport.request(
            method, path, timeout=client.timeout, max_retries=client.max_retries, **options
        )


class Files(_Resource):
    def create(self, *, file: FileInput, purpose: str = "batch") -> FileObject:
        """Uploads a JSON Lines file of requests; each line is checked, and a bad one is refused by number."""
        name, content = _read(file)
        return file_from_json(self._request("POST", "/files", content=_multipart({"purpose": purpose}, name, content)))

    def retrieve(self, file_id: str) -> FileObject:
        return file_from_json(self._request("GET", f"/files/{_segment(file_id)}"))

    def list(self, *, purpose: str | None = None, limit: int = 20, after: str | None = None) -> CursorPage[FileObject]:
        query = {"purpose": purpose, "limit": limit, "after": after}
        return cursor_page_from_json(self._request("GET", "/files", query=query), file_from_json)

    def content(self, file_id: str) -> bytes:
        """The file's bytes: JSON Lines."""
        content = self._request("GET", f"/files/{_segment(file_id)}/content", raw=True)
        assert isinstance(content, bytes)
        return content

    def delete(self, file_id: str) -> bool:
        return bool(self._request("DELETE", f"/files/{_segment(file_id)}"))


class Batches(_Resource):
    def create(
        self,
        *,
        input_file_id: str,
        endpoint: str = "/v1/chat/completions",
        completion_window: str = "24h",
        metadata: dict[str, str] | None = None,
    ) -> Batch:
        body = {
            "input_file_id": input_file_id,
            "endpoint": endpoint,
            "completion_window": completion_window,
            "metadata": metadata,
        }
        return batch_from_json(self._request("POST", "/batches", body=body))

    def retrieve(self, batch_id: str) -> Batch:
        return batch_from_json(self._request("GET", f"/batches/{_segment(batch_id)}"))

    def list(self, *, limit: int = 20, after: str | None = None) -> CursorPage[Batch]:
        body = self._request("GET", "/batches", query={"limit": limit, "after": after})
        return cursor_page_from_json(body, batch_from_json)

    def cancel(self, batch_id: str) -> Batch:
        """Stops sending the batch's requests; those already answered stay in its output file."""
        return batch_from_json(self._request("POST", f"/batches/{_segment(batch_id)}/cancel"))


class _AsyncResource:
    """Runs the sync resource's methods in a worker thread."""

    def __init__(self, sync_resource: _Resource) -> None:
        self._sync = sync_resource

    async def _run(self, method_name: str, *args, **kwargs):
        return await asyncio.to_thread(getattr(self._sync, method_name), *args, **kwargs)


class AsyncFiles(_AsyncResource):
    def __init__(self, client: AsyncClient) -> None:
        super().__init__(Files(client))  # type: ignore[arg-type]  # only the options and the HTTP transport

    async def create(self, *, file: FileInput, purpose: str = "batch") -> FileObject:
        return await self._run("create", file=file, purpose=purpose)

    async def retrieve(self, file_id: str) -> FileObject:
        return await self._run("retrieve", file_id)

    async def list(
        self, *, purpose: str | None = None, limit: int = 20, after: str | None = None
    ) -> CursorPage[FileObject]:
        return await self._run("list", purpose=purpose, limit=limit, after=after)

    async def content(self, file_id: str) -> bytes:
        return await self._run("content", file_id)

    async def delete(self, file_id: str) -> bool:
        return await self._run("delete", file_id)


class AsyncBatches(_AsyncResource):
    def __init__(self, client: AsyncClient) -> None:
        super().__init__(Batches(client))  # type: ignore[arg-type]  # only the options and the HTTP transport

    async def create(
        self,
        *,
        input_file_id: str,
        endpoint: str = "/v1/chat/completions",
        completion_window: str = "24h",
        metadata: dict[str, str] | None = None,
    ) -> Batch:
        return await self._run(
            "create",
            input_file_id=input_file_id,
            endpoint=endpoint,
            completion_window=completion_window,
            metadata=metadata,
        )

    async def retrieve(self, batch_id: str) -> Batch:
        return await self._run("retrieve", batch_id)

    async def list(self, *, limit: int = 20, after: str | None = None) -> CursorPage[Batch]:
        return await self._run("list", limit=limit, after=after)

    async def cancel(self, batch_id: str) -> Batch:
        return await self._run("cancel", batch_id)


def _read(file: FileInput) -> tuple[str, bytes]:
    if isinstance(file, tuple):
        return file
    if isinstance(file, bytes):
        return "input.jsonl", file
    if isinstance(file, (str, os.PathLike)):
        path = Path(file)
        return path.name, path.read_bytes()
    return Path(getattr(file, "name", "input.jsonl")).name, file.read()


def _multipart(fields: dict[str, str], filename: str, content: bytes) -> tuple[bytes, str]:
    """A multipart/form-data body with `fields` and one file part named "file"."""
    boundary = uuid.uuid4().hex
    parts = [
        f'--{boundary}\r\nContent-Disposition: form-data; name="{name}"\r\n\r\n{value}\r\n'.encode()
        for name, value in fields.items()
    ]
    safe_name = filename.replace('"', "_").replace("\r", "_").replace("\n", "_")
    parts.append(
        f'--{boundary}\r\nContent-Disposition: form-data; name="file"; filename="{safe_name}"\r\n'
        "Content-Type: application/jsonl\r\n\r\n".encode()
        + content
        + b"\r\n"
    )
    parts.append(f"--{boundary}--\r\n".encode())
    return b"".join(parts), f"multipart/form-data; boundary={boundary}"


def _segment(identifier: str) -> str:
    return quote(identifier, safe="")
