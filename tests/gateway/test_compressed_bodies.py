"""Compressed request bodies over a real socket: gzip and deflate bodies are read as the JSON they inflate
to, within the same size limit counted once inflated (a decompression bomb is a 413, refused while it
inflates); a body not compressed as its Content-Encoding says, or another Content-Encoding, is a JSON 400;
every request on a kept-alive connection is answered, even when each body is corrupt. `Expect` gets the
JSON shape too, and 100-continue still works."""

import asyncio
import gzip
import json
import tracemalloc
import zlib

import httpx
import pytest

from gateway.bodies import MAX_BODY_BYTES
from gateway.openai_api.batches import BatchApiProxy
from tests.gateway.harness import API_KEY, MODEL, assert_openai_error_shape, in_process_gateway, post_json

BODY = json.dumps({"model": MODEL, "prompt": "hi", "max_tokens": 1}).encode()
HEAD = (
    b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer " + API_KEY.encode() + b"\r\n"
    b"Content-Type: application/json\r\n"
)


@pytest.fixture
async def gateway(tmp_path):
    async with in_process_gateway(tmp_path) as gateway:
        yield gateway


def _raw_deflate(data: bytes) -> bytes:
    compressor = zlib.compressobj(wbits=-zlib.MAX_WBITS)
    return compressor.compress(data) + compressor.flush()


@pytest.mark.parametrize(
    ("encoding", "body"),
    [
        ("gzip", gzip.compress(BODY)),
        ("x-gzip", gzip.compress(BODY)),
        ("deflate", zlib.compress(BODY)),
        ("deflate", _raw_deflate(BODY)),
        ("identity", BODY),
        (" GZIP ", gzip.compress(BODY)),
    ],
)
async def test_a_compressed_body_is_read_as_the_json_it_inflates_to(gateway, encoding, body):
    status, payload = await post_json(gateway, "/v1/completions", body, {"Content-Encoding": encoding})
    assert status == 503 and payload["error"]["type"] == "service_unavailable", payload  # past the door
    assert gateway.path.runs == 1


@pytest.mark.parametrize(
    ("encoding", "body", "message"),
    [
        ("gzip", BODY, "not valid gzip data (Error -3"),
        ("deflate", BODY, "not valid deflate data"),
        ("deflate", b"abc", "not valid deflate data (the compressed data ends before its stream does)"),
        ("gzip", gzip.compress(BODY)[:-9], "not valid gzip data (the compressed data ends before its stream does)"),
        ("gzip", gzip.compress(BODY) + b"tail", "not valid gzip data (bytes follow the end of the compressed stream)"),
    ],
)
async def test_a_body_not_compressed_as_it_says_is_a_400(gateway, encoding, body, message):
    status, payload = await post_json(gateway, "/v1/completions", body, {"Content-Encoding": encoding})
    assert status == 400, payload
    assert_openai_error_shape(payload)
    assert message in payload["error"]["message"], payload
    assert gateway.path.runs == 0


@pytest.mark.parametrize("encoding", ["br", "zstd", "compress", "gzip, deflate", "gzip, gzip"])
async def test_another_content_encoding_is_a_400_naming_it(gateway, encoding):
    status, payload = await post_json(gateway, "/v1/completions", BODY, {"Content-Encoding": encoding})
    assert status == 400, payload
    assert_openai_error_shape(payload)
    assert f"Content-Encoding '{encoding}' is not supported" in payload["error"]["message"]
    assert gateway.path.runs == 0


def _bomb(inflated_bytes: int) -> bytes:
    """A deflate body of `inflated_bytes` zeros, compressed a MiB at a time."""
    compressor, zeros = zlib.compressobj(9), bytes(1 << 20)
    chunks = [compressor.compress(zeros) for _ in range(inflated_bytes >> 20)]
    return b"".join(chunks) + compressor.flush()


async def test_a_decompression_bomb_is_a_413_refused_while_it_inflates(gateway):
    bomb = _bomb(16 * MAX_BODY_BYTES)  # 128 MiB once inflated, 128 KB as sent
    tracemalloc.start()
    try:
        status, payload = await post_json(gateway, "/v1/completions", bomb, {"Content-Encoding": "deflate"})
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert status == 413, payload
    assert_openai_error_shape(payload)
    assert f"larger than {MAX_BODY_BYTES} bytes once inflated" in payload["error"]["message"]
    assert peak < 3 * MAX_BODY_BYTES, f"{peak >> 20} MiB held while refusing it: it was inflated whole"
    assert gateway.path.runs == 0


async def test_the_size_limit_counts_the_inflated_body(gateway):
    body = json.dumps({"model": MODEL, "prompt": "x" * MAX_BODY_BYTES}).encode()  # compresses to 8 KB
    status, payload = await post_json(gateway, "/v1/completions", gzip.compress(body), {"Content-Encoding": "gzip"})
    assert status == 413, payload
    assert f"larger than {MAX_BODY_BYTES} bytes once inflated" in payload["error"]["message"]


async def _answer(reader: asyncio.StreamReader) -> tuple[bytes, dict]:
    """The status line and parsed JSON body of the next answer on the connection."""
    head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 10)  # a hang guard, not a timing
    status, *lines = head.decode().split("\r\n")
    headers = {name.lower(): value for name, _, value in (line.partition(": ") for line in lines if line)}
    assert headers["content-type"].startswith("application/json"), head
    body = await asyncio.wait_for(reader.readexactly(int(headers["content-length"])), 10)
    return status.encode(), json.loads(body)


async def test_every_bad_deflate_request_on_one_kept_alive_connection_is_answered(gateway):
    """Each body is sent only once the server has started on its request (it asked for it, `Expect:
    100-continue`): aiohttp's own decompression found the corrupt body then, and the request waited for
    ever, and every later one on the connection with it."""
    reader, writer = await asyncio.open_connection("127.0.0.1", gateway.http.server.port)
    try:
        for _ in range(5):
            writer.write(HEAD + b"Content-Encoding: deflate\r\nContent-Length: 3\r\nExpect: 100-continue\r\n\r\n")
            assert await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 10) == b"HTTP/1.1 100 Continue\r\n\r\n"
            writer.write(b"abc")
            status, payload = await _answer(reader)
            assert status == b"HTTP/1.1 400 Bad Request", payload
            assert "not valid deflate data" in payload["error"]["message"]
    finally:
        writer.close()
    assert gateway.path.runs == 0


async def test_bad_deflate_requests_sent_back_to_back_on_one_connection_are_each_answered(gateway):
    reader, writer = await asyncio.open_connection("127.0.0.1", gateway.http.server.port)
    try:
        writer.write((HEAD + b"Content-Encoding: deflate\r\nContent-Length: 3\r\n\r\nabc") * 5)
        for _ in range(5):
            status, payload = await _answer(reader)
            assert status == b"HTTP/1.1 400 Bad Request" and "not valid deflate data" in payload["error"]["message"]
    finally:
        writer.close()


async def test_an_http_client_keeping_its_connection_gets_every_answer(gateway):
    base_url = f"http://127.0.0.1:{gateway.http.server.port}"
    headers = {"Authorization": f"Bearer {API_KEY}", "Content-Encoding": "deflate"}
    async with httpx.AsyncClient(base_url=base_url, headers=headers, timeout=10) as client:
        for body in [b"abc", BODY, b"abc", zlib.compress(BODY)]:
            response = await client.post("/v1/completions", content=body)
            assert response.status_code in (400, 503), response.text
            assert_openai_error_shape(response.json())
    assert gateway.path.runs == 1  # the one valid body


async def test_an_unknown_expectation_is_a_json_417(gateway):
    status, payload = await post_json(gateway, "/v1/completions", BODY, {"Expect": "nope"})
    assert status == 417, payload
    assert_openai_error_shape(payload)
    assert "the Expect header asks for 'nope'" in payload["error"]["message"]
    status, payload = await post_json(gateway, "/v1/nowhere", BODY, {"Expect": "nope"})
    assert status == 417 and payload is not None, payload
    assert gateway.path.runs == 0


async def test_expect_100_continue_still_gets_the_body_read(gateway):
    reader, writer = await asyncio.open_connection("127.0.0.1", gateway.http.server.port)
    try:
        writer.write(HEAD + b"Content-Length: %d\r\nExpect: 100-continue\r\n\r\n" % len(BODY))
        assert await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 10) == b"HTTP/1.1 100 Continue\r\n\r\n"
        writer.write(BODY)
        status, payload = await _answer(reader)
    finally:
        writer.close()
    assert status == b"HTTP/1.1 503 Service Unavailable", payload  # past the door: the harness has no workers
    assert gateway.path.runs == 1


async def test_the_batch_proxy_refuses_a_corrupt_body_before_forwarding_it(tmp_path):
    proxy = BatchApiProxy("http://127.0.0.1:9")  # nothing listens: a forwarded call would be a 503
    try:
        async with in_process_gateway(tmp_path, batch_api=proxy) as gateway:
            status, payload = await post_json(gateway, "/v1/batches", b"{}", {"Content-Encoding": "gzip"})
            assert status == 400, payload
            assert_openai_error_shape(payload)
            assert "not valid gzip data" in payload["error"]["message"]
    finally:
        await proxy.close()
