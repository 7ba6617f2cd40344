"""Bad input at the gateway's front doors gets a precise 4xx / INVALID_ARGUMENT and runs nothing: malformed
JSON and protobuf, text that is not Unicode, headers that cannot hold what they name, fields of the wrong
type, prompts too large to tokenize, and sampling parameters a sampler cannot compute with."""

import asyncio
import json
import threading

import grpc
import pytest

from diptych_proto.v1 import inference_pb2, inference_pb2_grpc
from gateway.openai_api.app import MAX_BODY_BYTES
from gateway.planning import validation
from gateway.planning.json_body import MAX_BODY_DEPTH
from gateway.planning.tokenization import TOKENIZER_THREAD_PREFIX
from tests.gateway.harness import (
    API_KEY,
    CONTEXT_LENGTH,
    MODEL,
    assert_openai_error_shape,
    generate_raw,
    in_process_gateway,
    post_json,
    raw_http,
)

PROMPT_LIMIT = validation.PROMPT_BYTES_PER_TOKEN * CONTEXT_LENGTH


@pytest.fixture
async def gateway(tmp_path):
    async with in_process_gateway(tmp_path) as gateway:
        yield gateway


def _nested(depth: int) -> str:
    return "[" * depth + "]" * depth


BAD_BODIES = [  # (raw body, URL, HTTP status, param, part of the message)
    (
        b'{"model": "diptych-tiny", "prompt": ' + _nested(100_000).encode() + b"}",
        "/v1/completions",
        400,
        None,
        "nests deeper",
    ),
    (
        b'{"model": "diptych-tiny", "prompt": ' + _nested(MAX_BODY_DEPTH + 1).encode() + b"}",
        "/v1/completions",
        400,
        "prompt",
        "nests deeper",
    ),
    (b'{"model": "diptych-tiny", "prompt": "a\\ud800b"}', "/v1/completions", 400, "prompt", "lone UTF-16 surrogate"),
    (b'{"model": "\\udfff", "prompt": "a"}', "/v1/completions", 400, "model", "lone UTF-16 surrogate"),
    (b'{"model": "diptych-tiny", "prompt": "a", "stop": ["\\ud800"]}', "/v1/completions", 400, "stop", "surrogate"),
    (
        b'{"model": "diptych-tiny", "messages": [{"role": "user", "content": "\\ud83d"}]}',
        "/v1/chat/completions",
        400,
        "messages",
        "surrogate",
    ),
    (b'{"model": "diptych-tiny", "prompt": "a", "\\ud800": 1}', "/v1/completions", 400, None, "surrogate"),
    (
        b'{"model": "diptych-tiny", "prompt": "a", "priority": ["batch"]}',
        "/v1/completions",
        400,
        "priority",
        "priority must",
    ),
    (
        b'{"model": "diptych-tiny", "prompt": "a", "priority": {"a": 1}}',
        "/v1/completions",
        400,
        "priority",
        "priority must",
    ),
    (
        b'{"model": "diptych-tiny", "messages": [{"role": ["user"], "content": "x"}]}',
        "/v1/chat/completions",
        400,
        "messages",
        "messages[0].role",
    ),
    (b'{"model": ["diptych-tiny"], "prompt": "a"}', "/v1/completions", 400, "model", "model must be a string"),
    (
        b'{"model": "diptych-tiny", "prompt": "a", "temperature": NaN}',
        "/v1/completions",
        400,
        None,
        "not a JSON number",
    ),
    (
        b'{"model": "diptych-tiny", "prompt": "a", "seed": ' + b"9" * 5000 + b"}",
        "/v1/completions",
        400,
        None,
        "not valid JSON",
    ),
    (b'{"model": "diptych-tiny", "prompt": "\xff\xfe"}', "/v1/completions", 400, None, "not valid JSON"),
    (
        b'{"model": "diptych-tiny", "prompt": "a", "stream": true, "stream_options": [1]}',
        "/v1/completions",
        400,
        "stream_options",
        "stream_options must be an object",
    ),
    (
        b'{"model": "diptych-tiny", "prompt": "a", "stream": false, "stream_options": "yes"}',
        "/v1/completions",
        400,
        "stream_options",
        "stream_options must be an object",
    ),
    (b"[1, 2]", "/v1/completions", 400, None, "must be a JSON object"),
]


@pytest.mark.parametrize(("body", "url", "status", "param", "message"), BAD_BODIES)
async def test_bad_bodies_get_a_4xx_naming_the_parameter_and_run_nothing(gateway, body, url, status, param, message):
    got_status, payload = await post_json(gateway, url, body)
    assert got_status == status, payload
    assert_openai_error_shape(payload)
    assert message in payload["error"]["message"]
    assert payload["error"]["param"] == param
    assert gateway.path.runs == 0


async def test_a_body_over_the_size_limit_is_a_json_413(gateway):
    body = json.dumps({"model": MODEL, "prompt": "x" * MAX_BODY_BYTES}).encode()
    status, payload = await post_json(gateway, "/v1/completions", body)
    assert status == 413
    assert_openai_error_shape(payload)
    assert str(MAX_BODY_BYTES) in payload["error"]["message"]
    assert gateway.path.runs == 0


@pytest.mark.parametrize(
    ("header", "status", "param"),
    [
        ({"Authorization": "Bearer dip_\u00e9t\u00e9"}, 401, None),
        ({"Authorization": "Bearer " + API_KEY + "\u2028"}, 401, None),
        ({"Idempotency-Key": "cl\u00e9"}, 400, "idempotency_key"),
    ],
)
async def test_headers_that_are_not_printable_ascii_are_refused(gateway, header, status, param):
    body = json.dumps({"model": MODEL, "prompt": "hi"}).encode()
    got_status, payload = await post_json(gateway, "/v1/completions", body, header)
    assert got_status == status, payload
    assert_openai_error_shape(payload)
    assert "printable ASCII" in payload["error"]["message"]
    assert payload["error"]["param"] == param
    assert gateway.path.runs == 0


async def test_a_non_ascii_authorization_header_is_refused_on_the_models_endpoint_too(gateway):
    async with gateway.http.get("/v1/models", headers={"Authorization": "Bearer \u00e9"}) as response:
        assert response.status == 401
        assert_openai_error_shape(await response.json())


async def test_aiohttp_s_own_errors_have_the_json_shape(gateway):
    async with gateway.http.get("/v1/nowhere") as response:
        assert response.status == 404
        assert_openai_error_shape(await response.json())
    async with gateway.http.get("/v1/completions") as response:
        assert response.status == 405
        assert_openai_error_shape(await response.json())


async def _raw_http(gateway, head: bytes) -> tuple[bytes, bytes]:
    return await raw_http(gateway, b"GET /v1/models HTTP/1.1\r\nHost: 127.0.0.1\r\n" + head)


@pytest.mark.parametrize(
    ("head", "message"),
    [
        (b"X-Trace: a\x01b\r\n", "malformed (Invalid header value char)"),
        (b"X-Trace: a\x7fb\r\n", "malformed (Invalid header value char)"),
        (b"X-Trace: " + b"a" * 9000 + b"\r\n", "over 8190 bytes"),
        (b"X-" + b"a" * 9000 + b": 1\r\n", "over 8190 bytes"),
        (b"".join(b"X-%d: 1\r\n" % i for i in range(200)), "malformed (Too many headers received)"),
    ],
)
async def test_heads_aiohttp_refuses_get_the_json_error_shape(gateway, head, message):
    status_and_headers, body = await _raw_http(gateway, head)
    assert status_and_headers.startswith(b"HTTP/1.0 400 ") and b"application/json" in status_and_headers, body
    payload = json.loads(body)
    assert_openai_error_shape(payload)
    assert payload["error"]["type"] == "invalid_request_error" and message in payload["error"]["message"]


async def test_a_header_within_aiohttp_s_limit_still_reaches_the_gateway(gateway):
    status_and_headers, body = await _raw_http(gateway, b"X-Trace: " + b"a" * 8000 + b"\r\n")
    assert status_and_headers.startswith(b"HTTP/1.1 401 "), status_and_headers  # past the parser, no API key
    assert json.loads(body)["error"]["type"] == "authentication_error"


@pytest.mark.parametrize(
    ("payload", "details"),
    [
        (b"\xff\xff\xff\xff", "Wire format was corrupt"),
        (inference_pb2.GenerateRequest(model=MODEL).SerializeToString() + b"\x12\x02\xc3\x28", "UTF-8"),
    ],
)
async def test_malformed_protobuf_is_invalid_argument(gateway, payload, details):
    call = gateway.channel.unary_stream("/diptych.v1.Inference/Generate")(
        payload, metadata=(("authorization", f"Bearer {API_KEY}"),), timeout=10
    )
    with pytest.raises(grpc.aio.AioRpcError) as raised:
        async for _ in call:
            pass
    assert raised.value.code() is grpc.StatusCode.INVALID_ARGUMENT
    assert details in raised.value.details() and "GenerateRequest" in raised.value.details()
    assert gateway.path.runs == 0


async def test_malformed_protobuf_is_invalid_argument_on_list_models_too(gateway):
    call = gateway.channel.unary_unary("/diptych.v1.Inference/ListModels")(
        b"\xff\xff\xff\xff", metadata=(("authorization", f"Bearer {API_KEY}"),), timeout=10
    )
    with pytest.raises(grpc.aio.AioRpcError) as raised:
        await call
    assert raised.value.code() is grpc.StatusCode.INVALID_ARGUMENT
    details = raised.value.details()
    assert "Wire format was corrupt" in details and "send a serialized ListModelsRequest" in details


async def test_a_well_formed_request_still_reaches_the_workers_over_grpc(gateway):
    assert (
        await generate_raw(gateway, inference_pb2.GenerateRequest(model=MODEL, prompt="hi").SerializeToString())
        is grpc.StatusCode.UNAVAILABLE
    )  # past the door; the harness has no workers
    assert gateway.path.runs == 1


async def _generate_error(gateway, **fields) -> grpc.aio.AioRpcError | None:
    stub = inference_pb2_grpc.InferenceStub(gateway.channel)
    call = stub.Generate(
        inference_pb2.GenerateRequest(model=MODEL, **fields), metadata=(("authorization", f"Bearer {API_KEY}"),)
    )
    try:
        async for _ in call:
            pass
    except grpc.aio.AioRpcError as error:
        return error
    return None


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        (
            {"temperature": 1e-40},
            "temperature 1e-40 is too small to sample with safely; send 0 for greedy decoding or at least 0.01",
        ),
        ({"temperature": 0.009}, "too small to sample with safely"),
        ({"temperature": float("nan")}, "temperature must be between 0 and 2 (0 is greedy), got nan"),
        ({"temperature": float("inf")}, "temperature must be between 0 and 2"),
        ({"temperature": -0.5}, "temperature must be between 0 and 2"),
        ({"top_p": 1e-40}, "top_p 1e-40 is too small to sample with safely; send at least 0.001"),
        ({"top_p": float("nan")}, "top_p must be greater than 0 and at most 1, got nan"),
        ({"top_p": float("-inf")}, "top_p must be greater than 0"),
    ],
)
async def test_sampling_parameters_a_sampler_cannot_compute_with_are_refused(gateway, fields, message):
    error = await _generate_error(gateway, prompt="hi", **fields)
    assert error is not None and error.code() is grpc.StatusCode.INVALID_ARGUMENT
    assert message in error.details()
    assert gateway.path.runs == 0


@pytest.mark.parametrize(
    "fields",
    [
        {"temperature": 0.0},
        {"temperature": validation.MIN_TEMPERATURE},
        {"temperature": 2.0},
        {"top_p": validation.MIN_TOP_P},
        {"top_p": 1.0},
    ],
)
async def test_the_documented_sampling_bounds_are_accepted(gateway, fields):
    error = await _generate_error(gateway, prompt="hi", **fields)
    assert error is not None and error.code() is grpc.StatusCode.UNAVAILABLE  # past the door; no workers here
    assert gateway.path.runs == 1


class _RecordingEncoder:
    """Wraps a tokenization function, recording the threads it ran on."""

    def __init__(self, encode, before=None) -> None:
        self._encode = encode
        self._before = before
        self.threads: list[threading.Thread] = []

    def __call__(self, *args):
        self.threads.append(threading.current_thread())
        if self._before is not None:
            self._before()
        return self._encode(*args)


async def test_prompts_over_the_byte_limit_are_refused_before_tokenizing(gateway, monkeypatch):
    encode = _RecordingEncoder(validation.encode_prompt)
    monkeypatch.setattr(validation, "encode_prompt", encode)
    body = json.dumps({"model": MODEL, "prompt": "\u00e9" * (PROMPT_LIMIT // 2 + 1)}).encode()  # 2 bytes each
    status, payload = await post_json(gateway, "/v1/completions", body)
    assert status == 400 and payload["error"]["param"] == "prompt"
    expected = f"prompt is {PROMPT_LIMIT + 2} bytes; {MODEL} takes at most {PROMPT_LIMIT} bytes"
    assert expected in payload["error"]["message"]
    assert encode.threads == []


@pytest.mark.parametrize(
    ("messages", "message"),
    [
        ([{"role": "user", "content": "x" * (PROMPT_LIMIT + 1)}], "chat.messages[0].content is"),
        ([{"role": "user", "content": "x" * (PROMPT_LIMIT // 2)}] * 3, "chat.messages hold"),
    ],
)
async def test_chat_content_over_the_byte_limit_is_refused_before_rendering(gateway, monkeypatch, messages, message):
    encode = _RecordingEncoder(validation.encode_chat)
    monkeypatch.setattr(validation, "encode_chat", encode)
    body = json.dumps({"model": MODEL, "messages": messages}).encode()
    status, payload = await post_json(gateway, "/v1/chat/completions", body)
    assert status == 400, payload
    assert message in payload["error"]["message"] and f"at most {PROMPT_LIMIT} bytes" in payload["error"]["message"]
    assert encode.threads == []


@pytest.mark.parametrize(
    ("name", "url", "body"),
    [
        ("encode_prompt", "/v1/completions", {"model": MODEL, "prompt": "hello there", "max_tokens": 1}),
        ("encode_chat", "/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}),
    ],
)
async def test_tokenizing_runs_off_the_event_loop_while_the_loop_serves_others(gateway, monkeypatch, name, url, body):
    """The tokenizer, once started, waits until another task of the event loop has run: run on the loop,
    it would stall the loop until its timeout, and on the loop's thread."""
    loop = asyncio.get_running_loop()
    encoding = asyncio.Event()
    loop_ran = threading.Event()
    waits: list[bool] = []  # whether the loop ran while the tokenizer waited

    def signal_then_wait() -> None:
        loop.call_soon_threadsafe(encoding.set)
        waits.append(loop_ran.wait(timeout=5))

    encode = _RecordingEncoder(getattr(validation, name), before=signal_then_wait)
    monkeypatch.setattr(validation, name, encode)

    async def other_stream():
        await encoding.wait()
        loop_ran.set()

    ticker = asyncio.create_task(other_stream())
    status, payload = await post_json(gateway, url, json.dumps(body).encode())
    await asyncio.wait_for(ticker, timeout=5)
    assert waits == [True]
    assert status == 503 and payload["error"]["type"] == "service_unavailable", payload  # no workers here
    assert len(encode.threads) == 1
    assert encode.threads[0] is not threading.main_thread()
    assert encode.threads[0].name.startswith(TOKENIZER_THREAD_PREFIX)
    assert gateway.path.runs == 1


def test_a_long_unknown_model_name_is_quoted_short():
    assert validation._shown("m" * 10_000) == "'" + "m" * 61 + "...'"
    assert validation._shown("no-such-model") == "'no-such-model'"


DEEP_JSON = "[" * 1_000 + "]" * 1_000  # a RecursionError once, a 500 / UNKNOWN


async def test_json_nested_deep_inside_a_string_field_is_a_400_over_http(gateway):
    call = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": DEEP_JSON}}
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": None, "tool_calls": [call]}]
    status, payload = await post_json(
        gateway, "/v1/chat/completions", json.dumps({"model": MODEL, "messages": messages}).encode()
    )
    assert status == 400, payload
    assert_openai_error_shape(payload)
    assert "chat.messages[1].tool_calls holds arguments nesting deeper than 64 levels" in payload["error"]["message"]
    assert gateway.path.runs == 0


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        (
            {
                "prompt": "hi",
                "response_format": inference_pb2.ResponseFormat(type="json_schema", json_schema=DEEP_JSON),
            },
            "response_format.json_schema.schema nests deeper than 64 levels",
        ),
        (
            {
                "chat": inference_pb2.ChatMessages(messages=[inference_pb2.ChatMessage(role="user", content="hi")]),
                "tools": [inference_pb2.Tool(name="f", parameters=DEEP_JSON)],
            },
            "tools[0].function.parameters nests deeper than 64 levels",
        ),
        (
            {
                "chat": inference_pb2.ChatMessages(
                    messages=[
                        inference_pb2.ChatMessage(role="user", content="hi"),
                        inference_pb2.ChatMessage(
                            role="assistant", tool_calls=[inference_pb2.ToolCall(id="c", name="f", arguments=DEEP_JSON)]
                        ),
                    ]
                )
            },
            "chat.messages[1].tool_calls holds arguments nesting deeper than 64 levels",
        ),
    ],
)
async def test_json_nested_deep_inside_a_string_field_is_invalid_argument_over_grpc(gateway, fields, message):
    error = await _generate_error(gateway, **fields)
    assert error is not None and error.code() is grpc.StatusCode.INVALID_ARGUMENT, error
    assert message in error.details()
    assert gateway.path.runs == 0
