"""The one request parser of the API: JSON, bounded in size and depth, with text that is valid Unicode."""

import json

from django.conf import settings
from rest_framework import status
from rest_framework.exceptions import APIException, ParseError
from rest_framework.parsers import JSONParser

from controlplane.common.errors import body_too_large_message

# No request of the API nests deeper than a handful of levels; the bound stops a body such as
# "[[[[...]]]]" from exhausting the parser's recursion (a RecursionError would otherwise be a 500).
MAX_JSON_DEPTH = 32


class RequestTooLarge(APIException):
    status_code = status.HTTP_413_REQUEST_ENTITY_TOO_LARGE
    default_code = "request_too_large"


class BoundedJSONParser(JSONParser):
    """DRF's JSONParser, refusing with a 400 what would otherwise fail later as a 500: bodies over
    DATA_UPLOAD_MAX_MEMORY_SIZE, invalid UTF-8, nesting deeper than MAX_JSON_DEPTH, NaN and Infinity,
    and lone UTF-16 surrogates (`"\\ud800"`), which no database or UTF-8 response can hold."""

    def parse(self, stream, media_type=None, parser_context=None):
        text = _decoded(_read_bounded(stream))
        data = _loaded(text)
        check_depth_and_text(data)
        return data


def _read_bounded(stream) -> bytes:
    if stream is None:
        return b""
    limit = settings.DATA_UPLOAD_MAX_MEMORY_SIZE
    if limit is None:
        return stream.read()
    raw = stream.read(limit + 1)
    if len(raw) > limit:
        raise RequestTooLarge(body_too_large_message(limit))
    return raw


def _decoded(raw: bytes) -> str:
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as error:
        raise ParseError(
            f"The body is not valid UTF-8 (byte 0x{raw[error.start]:02x} at offset {error.start}): "
            "send JSON encoded as UTF-8."
        ) from None


def _loaded(text: str):
    try:
        return json.loads(text, parse_constant=_refuse_constant)
    except RecursionError:
        raise ParseError(too_deep_message()) from None
    except ValueError as error:
        raise ParseError(f"JSON parse error - {error}") from None


def _refuse_constant(name: str):
    raise ValueError(f"{name} is not valid JSON: send numbers that are finite")


def too_deep_message() -> str:
    return f"JSON nested too deeply: at most {MAX_JSON_DEPTH} levels of arrays and objects are accepted."


def check_depth_and_text(data) -> None:
    """Walks the parsed body without recursion, refusing deep nesting and lone surrogates."""
    pending = [(data, 0, "")]
    while pending:
        value, depth, path = pending.pop()
        if isinstance(value, str):
            _check_text(value, path)
        elif isinstance(value, (dict, list)):
            if depth >= MAX_JSON_DEPTH:
                raise ParseError(too_deep_message())
            pending.extend(_children(value, depth + 1, path))


def _children(container: dict | list, depth: int, path: str):
    if isinstance(container, list):
        return [(item, depth, f"{path}[{index}]") for index, item in enumerate(container)]
    children = []
    for key, item in container.items():
        child_path = f"{path}.{key}" if path else key
        _check_text(key, f"{child_path} (a key)")
        children.append((item, depth, child_path))
    return children


def _check_text(text: str, path: str) -> None:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as error:
        surrogate = f"\\u{ord(text[error.start]):04x}"
        where = f" at {path!r}" if path else ""
        raise ParseError(
            f"Invalid text{where}: {surrogate} is a lone UTF-16 surrogate; escape characters outside the "
            "Basic Multilingual Plane as a surrogate pair or send them as UTF-8."
        ) from None
