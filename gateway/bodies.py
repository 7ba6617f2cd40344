"""Request bodies as the HTTP front reads them: bounded, and decompressed here rather than by aiohttp.

aiohttp's own decompression is off (`server.py`): it failed a body that was not compressed as its
Content-Encoding said from inside the HTTP parser. A handler reading that body got a RequestPayloadError (a
500 with a traceback), or, when the body arrived after the handler had started, waited for ever: the parser
reported the error as a malformed request of its own, queued behind the request still waiting for its
body, which got neither its end nor the error; that request and every later one on the connection went
unanswered. Here the body is read as it was sent, then inflated off the event loop, its size counted as
it inflates: a body that inflates past MAX_BODY_BYTES is refused when it gets there, never inflated whole.
"""

import asyncio
import zlib
from concurrent.futures import ThreadPoolExecutor

from aiohttp import web

# Bounds the body, as sent and once inflated, before it is parsed: twice the longest prompt any model takes
# (validation.py's MAX_PROMPT_BYTES), for JSON's escapes and the rest of the body.
MAX_BODY_BYTES = 8 << 20
WINDOW_BITS = {"gzip": 16 + zlib.MAX_WBITS, "x-gzip": 16 + zlib.MAX_WBITS, "deflate": zlib.MAX_WBITS}
INFLATE_THREADS = 2  # zlib releases the GIL while it inflates
_inflaters = ThreadPoolExecutor(max_workers=INFLATE_THREADS, thread_name_prefix="diptych-inflate")


class BodyRefused(Exception):
    """Why a request's body cannot be read, and the HTTP status that says so."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message


async def read_body(request: web.Request) -> bytes:
    """The request's body, inflated as its Content-Encoding says (none, identity, gzip or deflate)."""
    try:
        raw = await request.read()
    except web.HTTPRequestEntityTooLarge:
        raise _too_large("") from None
    except web.RequestPayloadError:  # it ended before its length, or its chunked framing is broken
        raise BodyRefused(400, "the request body could not be read whole; send it again") from None
    encoding = request.headers.get("Content-Encoding", "").strip().lower()
    if encoding in ("", "identity") or not raw:  # no body (a GET) has nothing to inflate
        return raw
    if encoding not in WINDOW_BITS:
        shown = encoding if len(encoding) <= 40 else encoding[:37] + "..."
        raise BodyRefused(
            400,
            f"Content-Encoding '{shown}' is not supported; send the body uncompressed, or compressed once "
            "with gzip or deflate",
        )
    return await asyncio.get_running_loop().run_in_executor(_inflaters, inflate, raw, encoding)


def inflate(raw: bytes, encoding: str) -> bytes:
    """`raw` inflated: BodyRefused 413 once it inflates past MAX_BODY_BYTES (the rest is never inflated),
    400 when it is not one whole gzip or deflate stream. deflate is zlib's format, or the raw deflate some
    clients send."""
    bits = WINDOW_BITS[encoding]
    if encoding == "deflate" and not _has_zlib_header(raw):
        bits = -zlib.MAX_WBITS
    inflater = zlib.decompressobj(bits)
    try:
        body = inflater.decompress(raw, MAX_BODY_BYTES + 1)
    except zlib.error as error:
        raise _corrupt(encoding, str(error)) from None
    if len(body) > MAX_BODY_BYTES:
        raise _too_large(" once inflated")
    if not inflater.eof:
        raise _corrupt(encoding, "the compressed data ends before its stream does")
    if inflater.unused_data:
        raise _corrupt(encoding, "bytes follow the end of the compressed stream")
    return body


def _has_zlib_header(raw: bytes) -> bool:
    """RFC 1950: compression method 8 in the low bits of the first byte, the first two bytes a multiple of 31."""
    return len(raw) >= 2 and raw[0] & 0x0F == 8 and (raw[0] << 8 | raw[1]) % 31 == 0


def _corrupt(encoding: str, why: str) -> BodyRefused:
    return BodyRefused(
        400,
        f"the request body is not valid {encoding} data ({why}); compress the whole body as its "
        "Content-Encoding says, or send it uncompressed without Content-Encoding",
    )


def _too_large(when: str) -> BodyRefused:
    return BodyRefused(413, f"the request body is larger than {MAX_BODY_BYTES} bytes{when}; send a smaller request")
