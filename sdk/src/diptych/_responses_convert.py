"""Parsing the Responses API's JSON (responses, their items, their stream's events) into the SDK's typed
objects, refusing what breaks the contract."""

from __future__ import annotations

from typing import cast, get_args

from ._admin_convert import _field, _optional
from ._errors import APIResponseValidationError
from .types import (
    CursorPage,
    Response,
    ResponseError,
    ResponseEvent,
    ResponseFunctionCall,
    ResponseFunctionCallOutput,
    ResponseInputItem,
    ResponseMessage,
    ResponseOutputItem,
    ResponseStatus,
    ResponseUsage,
)


def response_from_json(body: object) -> Response:
    status = _field(body, "status", str)
    if status not in get_args(ResponseStatus):
        raise APIResponseValidationError(f"The gateway answered a response of unknown status {status!r}")
    usage = _optional(body, "usage", lambda obj, name: _usage(_field(obj, name, dict)))
    error = _optional(body, "error", lambda obj, name: _field(obj, name, dict))
    incomplete = _optional(body, "incomplete_details", lambda obj, name: _field(obj, name, dict))
    metadata = _optional(body, "metadata", lambda obj, name: _field(obj, name, dict)) or {}
    return Response(
        id=_field(body, "id", str),
        status=cast(ResponseStatus, status),
        model=_field(body, "model", str),
        created_at=_field(body, "created_at", int),
        output=[output_item_from_json(item) for item in _field(body, "output", list)],
        usage=usage,
        previous_response_id=_optional(body, "previous_response_id", _text),
        background=bool(_optional(body, "background", lambda obj, name: _field(obj, name, bool))),
        store=_optional(body, "store", lambda obj, name: _field(obj, name, bool)) is not False,
        error=None
        if error is None
        else ResponseError(code=_field(error, "code", str), message=_field(error, "message", str)),
        incomplete_reason=None if incomplete is None else _optional(incomplete, "reason", _text),
        metadata={str(key): str(value) for key, value in metadata.items()},
        completed_at=_optional(body, "completed_at", lambda obj, name: _field(obj, name, int)),
    )


def output_item_from_json(item: object) -> ResponseOutputItem:
    kind = _field(item, "type", str)
    if kind == "function_call":
        return _function_call(item)
    if kind == "message":
        return _message(item)
    raise APIResponseValidationError(f"The gateway answered an output item of unknown type {kind!r}")


def input_item_from_json(item: object) -> ResponseInputItem:
    if _field(item, "type", str) == "function_call_output":
        return ResponseFunctionCallOutput(
            id=_field(item, "id", str),
            call_id=_field(item, "call_id", str),
            output=_field(item, "output", str),
            status=_optional(item, "status", _text),
        )
    return output_item_from_json(item)


def input_items_page_from_json(body: object) -> CursorPage[ResponseInputItem]:
    return CursorPage(
        data=[input_item_from_json(item) for item in _field(body, "data", list)],
        has_more=_field(body, "has_more", bool),
        last_id=_optional(body, "last_id", _text),
    )


def event_from_json(body: object) -> ResponseEvent:
    item = _optional(body, "item", lambda obj, name: output_item_from_json(_field(obj, name, dict)))
    response = _optional(body, "response", lambda obj, name: response_from_json(_field(obj, name, dict)))
    return ResponseEvent(
        type=_field(body, "type", str),
        sequence_number=_field(body, "sequence_number", int),
        delta=_optional(body, "delta", _text),
        item_id=_optional(body, "item_id", _text),
        output_index=_optional(body, "output_index", lambda obj, name: _field(obj, name, int)),
        item=item,
        response=response,
    )


def _message(item: object) -> ResponseMessage:
    parts = _field(item, "content", list)
    return ResponseMessage(
        id=_field(item, "id", str),
        role=_field(item, "role", str),
        text="".join(_field(part, "text", str) for part in parts),
        status=_optional(item, "status", _text),
    )


def _function_call(item: object) -> ResponseFunctionCall:
    return ResponseFunctionCall(
        id=_field(item, "id", str),
        call_id=_field(item, "call_id", str),
        name=_field(item, "name", str),
        arguments=_field(item, "arguments", str),
        status=_optional(item, "status", _text),
    )


def _usage(usage: dict[str, object]) -> ResponseUsage:
    details = _field(usage, "input_tokens_details", dict)
    return ResponseUsage(
        input_tokens=_field(usage, "input_tokens", int),
        cached_tokens=_field(details, "cached_tokens", int),
        output_tokens=_field(usage, "output_tokens", int),
        total_tokens=_field(usage, "total_tokens", int),
    )


def _text(body: object, name: str) -> str:
    return _field(body, name, str)
