"""The Batch API: `client.files` (JSON Lines input and result files) and `client.batches` (run a file of
requests in the background at batch priority and price), over the control plane's REST API (`admin_url`).

Any key with the inference scope may use them. The asyncio twins run each call in a worker thread.
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
import uuid
from collections.abc import Mapping
from functools import cached_property, partial
from pathlib import Path
from typing import IO
from urllib.parse import quote

from .._batch_convert import batch_from_json, cursor_page_from_json, file_from_json
from .._response import async_to_raw_response_wrapper, to_raw_response_wrapper
from ..types import AsyncCursorPage, Batch, CursorPage, FileObject
from ._connections import ControlPlaneConnection

__all__ = ["Files", "AsyncFiles", "Batches", "AsyncBatches", "FileInput"]

# bytes, a path, an open binary file, or (filename, bytes)
FileInput = bytes | str | os.PathLike[str] | IO[bytes] | tuple[str, bytes]


class _Resource:
    def __init__(self, client: ControlPlaneConnection) -> None:
        self._client = client

    def _request(
        self,
        method: str,
        path: str,
        *,
        query: Mapping[str, object] | None = None,
        body: object = None,
        content: tuple[bytes, str] | None = None,
        raw: bool = False,
    ) -> object:
        client = self._client
        return client._admin_transport.request(
            method,
            path,
            query=query,
            body=body,
            content=content,
            raw=raw,
            timeout=client.timeout,
            max_retries=client.max_retries,
        )


class Files(_Resource):
    @cached_property
    def with_raw_response(self) -> FilesWithRawResponse:
        return FilesWithRawResponse(self)

    def create(self, *, file: FileInput, purpose: str = "batch") -> FileObject:
        """Uploads a JSON Lines file of requests; each line is checked, and a bad one is refused by number."""
        name, content = _read(file)
        return file_from_json(self._request("POST", "/files", content=_multipart({"purpose": purpose}, name, content)))

    def retrieve(self, file_id: str) -> FileObject:
        return file_from_json(self._request("GET", f"/files/{_segment(file_id)}"))

    def list(self, *, purpose: str | None = None, limit: int = 20, after: str | None = None) -> CursorPage[FileObject]:
        """A page of files, newest first; iterating it walks all of them, fetching the next pages as it goes."""
        query = {"purpose": purpose, "limit": limit, "after": after}
        page = cursor_page_from_json(self._request("GET", "/files", query=query), file_from_json)
        return dataclasses.replace(
            page, _next_page=partial(self.list, purpose=purpose, limit=limit, after=page.last_id)
        )

    def content(self, file_id: str) -> bytes:
        """The file's bytes: JSON Lines."""
        content = self._request("GET", f"/files/{_segment(file_id)}/content", raw=True)
        assert isinstance(content, bytes)
        return content

    def delete(self, file_id: str) -> bool:
        return bool(self._request("DELETE", f"/files/{_segment(file_id)}"))


class Batches(_Resource):
    @cached_property
    def with_raw_response(self) -> BatchesWithRawResponse:
        return BatchesWithRawResponse(self)

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
        """A page of batches, newest first; iterating it walks all of them, fetching the next pages as it goes."""
        body = self._request("GET", "/batches", query={"limit": limit, "after": after})
        page = cursor_page_from_json(body, batch_from_json)
        return dataclasses.replace(page, _next_page=partial(self.list, limit=limit, after=page.last_id))

    def cancel(self, batch_id: str) -> Batch:
        """Stops sending the batch's requests; those already answered stay in its output file."""
        return batch_from_json(self._request("POST", f"/batches/{_segment(batch_id)}/cancel"))


class AsyncFiles:
    """The asyncio twin of `Files`; each call runs in a worker thread."""

    def __init__(self, client: ControlPlaneConnection) -> None:
        self._sync = Files(client)

    @cached_property
    def with_raw_response(self) -> AsyncFilesWithRawResponse:
        return AsyncFilesWithRawResponse(self)

    async def create(self, *, file: FileInput, purpose: str = "batch") -> FileObject:
        return await asyncio.to_thread(self._sync.create, file=file, purpose=purpose)

    async def retrieve(self, file_id: str) -> FileObject:
        return await asyncio.to_thread(self._sync.retrieve, file_id)

    async def list(
        self, *, purpose: str | None = None, limit: int = 20, after: str | None = None
    ) -> AsyncCursorPage[FileObject]:
        """A page of files; `async for` over it walks all of them, fetching the next pages as it goes."""
        page = await asyncio.to_thread(self._sync.list, purpose=purpose, limit=limit, after=after)
        following = partial(self.list, purpose=purpose, limit=limit, after=page.last_id)
        return AsyncCursorPage(data=page.data, has_more=page.has_more, last_id=page.last_id, _next_page=following)

    async def content(self, file_id: str) -> bytes:
        return await asyncio.to_thread(self._sync.content, file_id)

    async def delete(self, file_id: str) -> bool:
        return await asyncio.to_thread(self._sync.delete, file_id)


class AsyncBatches:
    """The asyncio twin of `Batches`; each call runs in a worker thread."""

    def __init__(self, client: ControlPlaneConnection) -> None:
        self._sync = Batches(client)

    @cached_property
    def with_raw_response(self) -> AsyncBatchesWithRawResponse:
        return AsyncBatchesWithRawResponse(self)

    async def create(
        self,
        *,
        input_file_id: str,
        endpoint: str = "/v1/chat/completions",
        completion_window: str = "24h",
        metadata: dict[str, str] | None = None,
    ) -> Batch:
        return await asyncio.to_thread(
            self._sync.create,
            input_file_id=input_file_id,
            endpoint=endpoint,
            completion_window=completion_window,
            metadata=metadata,
        )

    async def retrieve(self, batch_id: str) -> Batch:
        return await asyncio.to_thread(self._sync.retrieve, batch_id)

    async def list(self, *, limit: int = 20, after: str | None = None) -> AsyncCursorPage[Batch]:
        """A page of batches; `async for` over it walks all of them, fetching the next pages as it goes."""
        page = await asyncio.to_thread(self._sync.list, limit=limit, after=after)
        following = partial(self.list, limit=limit, after=page.last_id)
        return AsyncCursorPage(data=page.data, has_more=page.has_more, last_id=page.last_id, _next_page=following)

    async def cancel(self, batch_id: str) -> Batch:
        return await asyncio.to_thread(self._sync.cancel, batch_id)


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


class FilesWithRawResponse:
    def __init__(self, resource: Files) -> None:
        self.create = to_raw_response_wrapper(resource.create)
        self.retrieve = to_raw_response_wrapper(resource.retrieve)
        self.list = to_raw_response_wrapper(resource.list)
        self.content = to_raw_response_wrapper(resource.content)
        self.delete = to_raw_response_wrapper(resource.delete)


class BatchesWithRawResponse:
    def __init__(self, resource: Batches) -> None:
        self.create = to_raw_response_wrapper(resource.create)
        self.retrieve = to_raw_response_wrapper(resource.retrieve)
        self.list = to_raw_response_wrapper(resource.list)
        self.cancel = to_raw_response_wrapper(resource.cancel)


class AsyncFilesWithRawResponse:
    def __init__(self, resource: AsyncFiles) -> None:
        self.create = async_to_raw_response_wrapper(resource.create)
        self.retrieve = async_to_raw_response_wrapper(resource.retrieve)
        self.list = async_to_raw_response_wrapper(resource.list)
        self.content = async_to_raw_response_wrapper(resource.content)
        self.delete = async_to_raw_response_wrapper(resource.delete)


class AsyncBatchesWithRawResponse:
    def __init__(self, resource: AsyncBatches) -> None:
        self.create = async_to_raw_response_wrapper(resource.create)
        self.retrieve = async_to_raw_response_wrapper(resource.retrieve)
        self.list = async_to_raw_response_wrapper(resource.list)
        self.cancel = async_to_raw_response_wrapper(resource.cancel)
