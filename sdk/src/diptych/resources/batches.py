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
from typing import IO, Any, TypeVar, Unpack

from .._batch_convert import batch_from_json, cursor_page_from_json, file_from_json
from .._http import json_body, raw_body
from .._response import (
    StreamedAPIResponse,
    async_to_raw_response_wrapper,
    async_to_streamed_response_wrapper,
    then,
    to_raw_response_wrapper,
    to_streamed_response_wrapper,
)
from ..types import AsyncCursorPage, Batch, CursorPage, FileObject, PostRequestOptions, RequestOptions
from ._connections import ControlPlaneConnection
from ._control_plane import ControlPlaneResource, from_json
from ._keyword_parameters import KeywordParameters
from ._paths import segment

__all__ = ["AsyncBatches", "AsyncFiles", "Batches", "FileInput", "Files"]

# bytes, a path, an open binary file, or (filename, bytes)
FileInput = bytes | str | os.PathLike[str] | IO[bytes] | tuple[str, bytes]

_OPTIONS = KeywordParameters(RequestOptions)
_POST_OPTIONS = KeywordParameters(PostRequestOptions)

T = TypeVar("T")


class Files(ControlPlaneResource):
    @cached_property
    def with_raw_response(self) -> FilesWithRawResponse:
        return FilesWithRawResponse(self)

    @cached_property
    def with_streaming_response(self) -> FilesWithStreamingResponse:
        """The calls answering a `StreamedAPIResponse`, in a `with` block: e.g. `content`'s lines with
        `iter_lines()`, as they arrive."""
        return FilesWithStreamingResponse(self)

    @_POST_OPTIONS.expand
    def create(self, *, file: FileInput, purpose: str = "batch", **options: Unpack[PostRequestOptions]) -> FileObject:
        """Uploads a JSON Lines file of requests; each line is checked, and a bad one is refused by number.
        `extra_body` adds form fields (text) beside `purpose`."""
        options = _POST_OPTIONS.complete(options)
        fields = {"purpose": purpose, **_form_fields(options.get("extra_body"))}
        name, content = _read(file)
        multipart = _multipart(fields, name, content)
        return self._request(
            "POST", "/files", from_json(file_from_json), {**options, "extra_body": None}, content=multipart
        )

    @_OPTIONS.expand
    def retrieve(self, file_id: str, **options: Unpack[RequestOptions]) -> FileObject:
        return self._request("GET", f"/files/{segment(file_id)}", from_json(file_from_json), _OPTIONS.complete(options))

    @_OPTIONS.expand
    def list(
        self,
        *,
        purpose: str | None = None,
        limit: int = 20,
        after: str | None = None,
        **options: Unpack[RequestOptions],
    ) -> CursorPage[FileObject]:
        """A page of files, newest first; iterating it walks all of them, fetching the next pages as it goes."""
        options = _OPTIONS.complete(options)

        def parse(response: StreamedAPIResponse[Any]) -> CursorPage[FileObject]:
            page = cursor_page_from_json(json_body(response), file_from_json)
            following = partial(self.list, purpose=purpose, limit=limit, after=page.last_id, **options)
            return dataclasses.replace(page, _next_page=following)

        query = {"purpose": purpose, "limit": limit, "after": after}
        return self._request("GET", "/files", parse, options, query=query)

    @_OPTIONS.expand
    def content(self, file_id: str, **options: Unpack[RequestOptions]) -> bytes:
        """The file's bytes: JSON Lines."""
        return self._request("GET", f"/files/{segment(file_id)}/content", raw_body, _OPTIONS.complete(options))

    @_OPTIONS.expand
    def delete(self, file_id: str, **options: Unpack[RequestOptions]) -> bool:
        return self._request("DELETE", f"/files/{segment(file_id)}", from_json(bool), _OPTIONS.complete(options))


class Batches(ControlPlaneResource):
    @cached_property
    def with_raw_response(self) -> BatchesWithRawResponse:
        return BatchesWithRawResponse(self)

    @cached_property
    def with_streaming_response(self) -> BatchesWithStreamingResponse:
        return BatchesWithStreamingResponse(self)

    @_POST_OPTIONS.expand
    def create(
        self,
        *,
        input_file_id: str,
        endpoint: str = "/v1/chat/completions",
        completion_window: str = "24h",
        metadata: dict[str, str] | None = None,
        **options: Unpack[PostRequestOptions],
    ) -> Batch:
        body = {
            "input_file_id": input_file_id,
            "endpoint": endpoint,
            "completion_window": completion_window,
            "metadata": metadata,
        }
        return self._request("POST", "/batches", from_json(batch_from_json), _POST_OPTIONS.complete(options), body=body)

    @_OPTIONS.expand
    def retrieve(self, batch_id: str, **options: Unpack[RequestOptions]) -> Batch:
        path = f"/batches/{segment(batch_id)}"
        return self._request("GET", path, from_json(batch_from_json), _OPTIONS.complete(options))

    @_OPTIONS.expand
    def list(
        self, *, limit: int = 20, after: str | None = None, **options: Unpack[RequestOptions]
    ) -> CursorPage[Batch]:
        """A page of batches, newest first; iterating it walks all of them, fetching the next pages as it goes."""
        options = _OPTIONS.complete(options)

        def parse(response: StreamedAPIResponse[Any]) -> CursorPage[Batch]:
            page = cursor_page_from_json(json_body(response), batch_from_json)
            following = partial(self.list, limit=limit, after=page.last_id, **options)
            return dataclasses.replace(page, _next_page=following)

        return self._request("GET", "/batches", parse, options, query={"limit": limit, "after": after})

    @_POST_OPTIONS.expand
    def cancel(self, batch_id: str, **options: Unpack[PostRequestOptions]) -> Batch:
        """Stops sending the batch's requests; those already answered stay in its output file."""
        path = f"/batches/{segment(batch_id)}/cancel"
        return self._request("POST", path, from_json(batch_from_json), _POST_OPTIONS.complete(options))


class AsyncFiles:
    """The asyncio twin of `Files`; each call runs in a worker thread."""

    def __init__(self, client: ControlPlaneConnection) -> None:
        self._sync = Files(client)

    @cached_property
    def with_raw_response(self) -> AsyncFilesWithRawResponse:
        return AsyncFilesWithRawResponse(self)

    @cached_property
    def with_streaming_response(self) -> AsyncFilesWithStreamingResponse:
        return AsyncFilesWithStreamingResponse(self)

    @_POST_OPTIONS.expand
    async def create(
        self, *, file: FileInput, purpose: str = "batch", **options: Unpack[PostRequestOptions]
    ) -> FileObject:
        return await asyncio.to_thread(partial(self._sync.create, file=file, purpose=purpose, **options))

    @_OPTIONS.expand
    async def retrieve(self, file_id: str, **options: Unpack[RequestOptions]) -> FileObject:
        return await asyncio.to_thread(partial(self._sync.retrieve, file_id, **options))

    @_OPTIONS.expand
    async def list(
        self,
        *,
        purpose: str | None = None,
        limit: int = 20,
        after: str | None = None,
        **options: Unpack[RequestOptions],
    ) -> AsyncCursorPage[FileObject]:
        """A page of files; `async for` over it walks all of them, fetching the next pages as it goes."""
        page = await asyncio.to_thread(partial(self._sync.list, purpose=purpose, limit=limit, after=after, **options))

        def asynchronous(page: CursorPage[FileObject]) -> AsyncCursorPage[FileObject]:
            following = partial(self.list, purpose=purpose, limit=limit, after=page.last_id, **options)
            return AsyncCursorPage(data=page.data, has_more=page.has_more, last_id=page.last_id, _next_page=following)

        return then(page, asynchronous)

    @_OPTIONS.expand
    async def content(self, file_id: str, **options: Unpack[RequestOptions]) -> bytes:
        return await asyncio.to_thread(partial(self._sync.content, file_id, **options))

    @_OPTIONS.expand
    async def delete(self, file_id: str, **options: Unpack[RequestOptions]) -> bool:
        return await asyncio.to_thread(partial(self._sync.delete, file_id, **options))


class AsyncBatches:
    """The asyncio twin of `Batches`; each call runs in a worker thread."""

    def __init__(self, client: ControlPlaneConnection) -> None:
        self._sync = Batches(client)

    @cached_property
    def with_raw_response(self) -> AsyncBatchesWithRawResponse:
        return AsyncBatchesWithRawResponse(self)

    @cached_property
    def with_streaming_response(self) -> AsyncBatchesWithStreamingResponse:
        return AsyncBatchesWithStreamingResponse(self)

    @_POST_OPTIONS.expand
    async def create(
        self,
        *,
        input_file_id: str,
        endpoint: str = "/v1/chat/completions",
        completion_window: str = "24h",
        metadata: dict[str, str] | None = None,
        **options: Unpack[PostRequestOptions],
    ) -> Batch:
        return await asyncio.to_thread(
            partial(
                self._sync.create,
                input_file_id=input_file_id,
                endpoint=endpoint,
                completion_window=completion_window,
                metadata=metadata,
                **options,
            )
        )

    @_OPTIONS.expand
    async def retrieve(self, batch_id: str, **options: Unpack[RequestOptions]) -> Batch:
        return await asyncio.to_thread(partial(self._sync.retrieve, batch_id, **options))

    @_OPTIONS.expand
    async def list(
        self, *, limit: int = 20, after: str | None = None, **options: Unpack[RequestOptions]
    ) -> AsyncCursorPage[Batch]:
        """A page of batches; `async for` over it walks all of them, fetching the next pages as it goes."""
        page = await asyncio.to_thread(partial(self._sync.list, limit=limit, after=after, **options))

        def asynchronous(page: CursorPage[Batch]) -> AsyncCursorPage[Batch]:
            following = partial(self.list, limit=limit, after=page.last_id, **options)
            return AsyncCursorPage(data=page.data, has_more=page.has_more, last_id=page.last_id, _next_page=following)

        return then(page, asynchronous)

    @_POST_OPTIONS.expand
    async def cancel(self, batch_id: str, **options: Unpack[PostRequestOptions]) -> Batch:
        return await asyncio.to_thread(partial(self._sync.cancel, batch_id, **options))


def _form_fields(extra_body: Mapping[str, object] | None) -> dict[str, str]:
    """`extra_body` of an upload: more form fields, each a text value."""
    if extra_body is None:
        return {}
    fields = {name: value for name, value in extra_body.items() if isinstance(value, str)}
    if len(fields) != len(extra_body):
        raise ValueError("extra_body of a file upload must map form field names to text values")
    return fields


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


class FilesWithStreamingResponse:
    def __init__(self, resource: Files) -> None:
        self.create = to_streamed_response_wrapper(resource.create)
        self.retrieve = to_streamed_response_wrapper(resource.retrieve)
        self.list = to_streamed_response_wrapper(resource.list)
        self.content = to_streamed_response_wrapper(resource.content)
        self.delete = to_streamed_response_wrapper(resource.delete)


class BatchesWithStreamingResponse:
    def __init__(self, resource: Batches) -> None:
        self.create = to_streamed_response_wrapper(resource.create)
        self.retrieve = to_streamed_response_wrapper(resource.retrieve)
        self.list = to_streamed_response_wrapper(resource.list)
        self.cancel = to_streamed_response_wrapper(resource.cancel)


class AsyncFilesWithStreamingResponse:
    def __init__(self, resource: AsyncFiles) -> None:
        self.create = async_to_streamed_response_wrapper(resource.create)
        self.retrieve = async_to_streamed_response_wrapper(resource.retrieve)
        self.list = async_to_streamed_response_wrapper(resource.list)
        self.content = async_to_streamed_response_wrapper(resource.content)
        self.delete = async_to_streamed_response_wrapper(resource.delete)


class AsyncBatchesWithStreamingResponse:
    def __init__(self, resource: AsyncBatches) -> None:
        self.create = async_to_streamed_response_wrapper(resource.create)
        self.retrieve = async_to_streamed_response_wrapper(resource.retrieve)
        self.list = async_to_streamed_response_wrapper(resource.list)
        self.cancel = async_to_streamed_response_wrapper(resource.cancel)
