"""Parsing the Batch API's JSON (files, batches, their lists) into the SDK's typed objects."""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

from ._admin_convert import _field, _optional
from .types import Batch, BatchRequestCounts, CursorPage, FileObject

T = TypeVar("T")

_MOMENTS = (
    "in_progress_at",
    "finalizing_at",
    "completed_at",
    "failed_at",
    "expired_at",
    "cancelling_at",
    "cancelled_at",
)


def cursor_page_from_json(body: object, parse_item: Callable[[object], T]) -> CursorPage[T]:
    return CursorPage(
        data=[parse_item(item) for item in _field(body, "data", list)],
        has_more=_field(body, "has_more", bool),
        last_id=_optional(body, "last_id", _text),
    )


def file_from_json(body: object) -> FileObject:
    return FileObject(
        id=_field(body, "id", str),
        bytes=_field(body, "bytes", int),
        created_at=_field(body, "created_at", int),
        filename=_field(body, "filename", str),
        purpose=_field(body, "purpose", str),
    )


def batch_from_json(body: object) -> Batch:
    counts = _field(body, "request_counts", dict)
    metadata = _optional(body, "metadata", lambda obj, name: _field(obj, name, dict))
    return Batch(
        id=_field(body, "id", str),
        endpoint=_field(body, "endpoint", str),
        input_file_id=_field(body, "input_file_id", str),
        completion_window=_field(body, "completion_window", str),
        status=_field(body, "status", str),
        output_file_id=_optional(body, "output_file_id", _text),
        error_file_id=_optional(body, "error_file_id", _text),
        request_counts=BatchRequestCounts(
            total=_field(counts, "total", int),
            completed=_field(counts, "completed", int),
            failed=_field(counts, "failed", int),
        ),
        created_at=_field(body, "created_at", int),
        expires_at=_field(body, "expires_at", int),
        metadata=None if metadata is None else {str(k): str(v) for k, v in metadata.items()},
        **{name: _optional(body, name, lambda obj, field: _field(obj, field, int)) for name in _MOMENTS},
    )


def _text(body: object, name: str) -> str:
    return _field(body, name, str)
