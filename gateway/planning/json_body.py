"""JSON from clients, read with bounds: how deep it nests, how many values it holds, and text that is
Unicode. Request bodies (`read_body`) and JSON texts inside a request's string fields (a tool call's
arguments, a schema: `loads_nested`) are read here.

A body over INLINE_BODY_BYTES is read in a process of its own (`read_body_off_loop`): json.loads holds the
GIL while it parses (0.2 to 0.7 s for 8 MB of small values on the 2-core development machine), so even in
a thread it would stall every stream of the gateway; in another process it costs only its own request
time. What comes back is bounded by MAX_BODY_VALUES.
"""

import asyncio
import json
import multiprocessing
import os
from concurrent.futures import ProcessPoolExecutor
from functools import lru_cache
from typing import Any, NoReturn

MAX_BODY_DEPTH = 16  # the deepest legitimate body: messages / a message / content parts / a part
MAX_BODY_VALUES = 200_000  # a prompt of token ids as long as the longest context, with room to spare
INLINE_BODY_BYTES = 64 << 10  # parsed on the event loop at most about 5 ms
PARSER_PROCESSES = 2
PARSER_NICENESS = 10  # below the gateway and the workers in the CPU's queue, as the tokenizer threads are


class JsonRefused(ValueError):
    """Why a client's JSON is refused; `param`: the body's top-level key at fault, where one is."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message, param)
        self.message = message
        self.param = param


class TooDeep(ValueError):
    pass


async def start_parsers(_app: object = None) -> None:
    """Starts the parser processes (an aiohttp on_startup hook), so that no request waits for them."""
    await asyncio.get_running_loop().run_in_executor(_parsers(), int)


async def read_body_off_loop(raw: bytes, params: frozenset[str]) -> dict[str, Any]:
    """`read_body`, in a parser process when the body is large."""
    if len(raw) <= INLINE_BODY_BYTES:
        return read_body(raw, params)
    return await asyncio.get_running_loop().run_in_executor(_parsers(), read_body, raw, params)


def read_body(raw: bytes, params: frozenset[str]) -> dict[str, Any]:
    """The request body as a JSON object, or JsonRefused naming the first of `params` at fault: not JSON,
    nested deeper than MAX_BODY_DEPTH, more than MAX_BODY_VALUES values, NaN or Infinity, or a string
    holding a lone UTF-16 surrogate (e.g. "\\ud800"), which is not Unicode text."""
    try:
        body = json.loads(raw, parse_constant=_refuse_constant)
    except RecursionError:
        raise JsonRefused(f"the request body nests deeper than {MAX_BODY_DEPTH} levels") from None
    except ValueError as error:  # JSONDecodeError, UnicodeDecodeError, an integer of too many digits
        raise JsonRefused(f"the request body is not valid JSON: {str(error)[:200]}") from None
    if not isinstance(body, dict):
        raise JsonRefused("the request body must be a JSON object")
    _check_values(body, params)
    return body


def loads_nested(text: str, max_depth: int) -> Any:
    """A JSON text from a string field, nesting at most `max_depth` levels: ValueError when it is not JSON or
    escapes a lone UTF-16 surrogate ("\\ud800", which no tokenizer or encoder takes), TooDeep (a ValueError)
    when it nests deeper, before anything recurses through it."""
    try:
        value = json.loads(text)
    except RecursionError:
        raise TooDeep(max_depth) from None
    pending = [(value, 1)]
    while pending:
        item, depth = pending.pop()
        if depth > max_depth:
            raise TooDeep(max_depth)
        if isinstance(item, str):
            _check_unicode(item)
        elif isinstance(item, dict):
            for key in item:
                _check_unicode(key)
            pending.extend((inner, depth + 1) for inner in item.values())
        elif isinstance(item, list):
            pending.extend((inner, depth + 1) for inner in item)
    return value


def _check_unicode(text: str) -> None:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        raise ValueError("a string holds a lone UTF-16 surrogate, which is not Unicode text") from None


def _refuse_constant(name: str) -> NoReturn:
    raise ValueError(f"{name} is not a JSON number; send a finite number")


def _check_values(body: dict[str, Any], params: frozenset[str]) -> None:
    _check_text(list(body), None, params)
    pending = [(value, 1, key) for key, value in body.items()]
    values = len(pending)
    while pending:
        value, depth, param = pending.pop()
        if depth > MAX_BODY_DEPTH:
            raise JsonRefused(f"the request body nests deeper than {MAX_BODY_DEPTH} levels", _named(param, params))
        if isinstance(value, str):
            _check_text([value], param, params)
        elif isinstance(value, dict):
            _check_text(list(value), param, params)
            pending.extend((item, depth + 1, param) for item in value.values())
            values += len(value)
        elif isinstance(value, list):
            pending.extend((item, depth + 1, param) for item in value)
            values += len(value)
        if values > MAX_BODY_VALUES:
            raise JsonRefused(
                f"the request body holds more than {MAX_BODY_VALUES} JSON values; send a smaller request",
                _named(param, params),
            )


def _check_text(strings: list[str], param: str | None, params: frozenset[str]) -> None:
    for text in strings:
        try:
            text.encode("utf-8")
        except UnicodeEncodeError:
            named = _named(param, params)
            where = f"{named} holds" if named else "the request body holds"
            raise JsonRefused(
                f"{where} a lone UTF-16 surrogate, which is not Unicode text; send valid UTF-8 text", named
            ) from None


def _named(param: str | None, params: frozenset[str]) -> str | None:
    return param if param in params else None


@lru_cache(maxsize=1)
def _parsers() -> ProcessPoolExecutor:
    # spawn: a fork would copy the gateway's threads' state (gRPC's among them) into the child
    spawn = multiprocessing.get_context("spawn")
    return ProcessPoolExecutor(PARSER_PROCESSES, mp_context=spawn, initializer=os.nice, initargs=(PARSER_NICENESS,))
