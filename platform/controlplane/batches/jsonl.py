"""Reads a batch input file: JSON Lines, one request a line, each checked before anything runs.

A line is `{"custom_id": "...", "method": "POST", "url": "/v1/chat/completions", "body": {...}}`. Every
line names the same url, and no two lines share a custom_id. The first bad line is refused, by number.
Each line is held to what the API's parser holds a request body to: bounded nesting, finite numbers and
text without lone surrogates. Lines end at "\n" alone (JSON Lines): JSON strings may hold U+2028 and the
other characters that `str.splitlines` would split at.
"""

import json
from dataclasses import dataclass

from rest_framework.exceptions import ParseError

from controlplane.common.errors import InvalidInput
from controlplane.common.parsers import check_depth_and_text, too_deep_message

ENDPOINTS = ("/v1/chat/completions", "/v1/completions")
MAX_CUSTOM_ID_LENGTH = 512
LINE_KEYS = {"custom_id", "method", "url", "body"}


@dataclass(frozen=True)
class InputLine:
    line_number: int  # 1-based, as an editor shows it
    custom_id: str
    body: dict


@dataclass(frozen=True)
class InputFile:
    endpoint: str
    lines: list[InputLine]


def parse_input_file(content: bytes, *, max_lines: int) -> InputFile:
    try:
        text = content.decode("utf-8")
    except UnicodeDecodeError as error:
        raise _refused(f"the file is not UTF-8 text (byte {error.start})") from None
    rows = [(number, row) for number, row in enumerate(text.split("\n"), start=1) if row.strip()]
    if not rows:
        raise _refused("the file holds no request; put one JSON object per line")
    if len(rows) > max_lines:
        raise _refused(f"the file holds {len(rows)} requests; a batch takes at most {max_lines}")
    lines: list[InputLine] = []
    endpoint = ""
    seen: dict[str, int] = {}
    for number, row in rows:
        line, url = _parse_line(number, row)
        endpoint = endpoint or url
        if url != endpoint:
            raise _line_refused(
                number,
                f"url is {url!r} but line {lines[0].line_number} names {endpoint!r}; "
                "every line of a batch names the same url",
            )
        if line.custom_id in seen:
            raise _line_refused(
                number,
                f"custom_id {line.custom_id!r} repeats line {seen[line.custom_id]}; "
                "give each request its own custom_id",
            )
        seen[line.custom_id] = number
        lines.append(line)
    return InputFile(endpoint=endpoint, lines=lines)


def _parse_line(number: int, row: str) -> tuple[InputLine, str]:
    value = _line_value(number, row)
    unknown = sorted(set(value) - LINE_KEYS)
    if unknown:
        raise _line_refused(number, f"unknown field {unknown[0]!r}; a line holds only custom_id, method, url, body")
    custom_id = value.get("custom_id")
    if not isinstance(custom_id, str) or not custom_id or len(custom_id) > MAX_CUSTOM_ID_LENGTH:
        raise _line_refused(
            number, f"custom_id must be a non-empty string of at most {MAX_CUSTOM_ID_LENGTH} characters"
        )
    if value.get("method") != "POST":
        raise _line_refused(number, f'method is {value.get("method")!r}; use "POST"')
    url = value.get("url")
    if url not in ENDPOINTS:
        raise _line_refused(number, f"url is {url!r}; use one of {', '.join(ENDPOINTS)}")
    body = value.get("body")
    if not isinstance(body, dict):
        raise _line_refused(number, "body must be a JSON object: the request's parameters")
    if body.get("stream") not in (None, False):
        raise _line_refused(number, "body.stream must be false or absent: a batch stores whole answers")
    return InputLine(line_number=number, custom_id=custom_id, body=body), url


def _line_value(number: int, row: str) -> dict:
    """The line as a JSON object, within the depth and text limits."""
    try:
        value = json.loads(row, parse_constant=_refuse_constant)
        check_depth_and_text(value)
    except RecursionError:
        raise _line_refused(number, too_deep_message().rstrip(".")) from None
    except ParseError as error:
        raise _line_refused(number, str(error.detail).rstrip(".")) from None
    except ValueError as error:
        raise _line_refused(number, f"not valid JSON ({str(error)[:120]})") from None
    if not isinstance(value, dict):
        raise _line_refused(number, "must be a JSON object with custom_id, method, url and body")
    return value


def _refuse_constant(name: str):
    raise ValueError(f"{name} is not a JSON number")


def _refused(message: str) -> InvalidInput:
    return InvalidInput(f"Invalid batch input file: {message}.", fields={"file": [message]})


def _line_refused(number: int, message: str) -> InvalidInput:
    return InvalidInput(
        f"Invalid batch input file: line {number}: {message}.", fields={"file": [f"line {number}: {message}"]}
    )
