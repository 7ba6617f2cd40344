"""A bounded fuzz of the gateway's front doors, in process: random JSON bodies (wrong types, text that is
not Unicode, huge and deeply nested values) against the OpenAI-compatible endpoints, and random or
mutated bytes against gRPC Generate. Whatever arrives, the answer is a client error with the documented
shape, or, for a request the door lets through, the UNAVAILABLE of a fleet with no workers (the harness
has none): never a server error, never UNKNOWN or INTERNAL."""

import asyncio
import json
import re
from contextlib import contextmanager
from urllib.parse import quote

import grpc
from django.core.signals import request_started
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from controlplane.tenancy.models import ApiKey, Organization
from controlplane.tenancy.services import api_key_create
from diptych_proto.v1 import inference_pb2
from gateway.openai_api.batches import IDS, ROUTES, BatchApiProxy
from tests.gateway.harness import MODEL, assert_openai_error_shape, generate_raw, in_process_gateway, raw_http
from tests.gateway.test_batch_proxy import ALL_SCOPES

FUZZ = settings(
    max_examples=200,
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.function_scoped_fixture],
)
FIELDS = (
    "model",
    "prompt",
    "messages",
    "max_tokens",
    "max_completion_tokens",
    "temperature",
    "top_p",
    "top_k",
    "seed",
    "stop",
    "n",
    "best_of",
    "echo",
    "logprobs",
    "top_logprobs",
    "presence_penalty",
    "stream",
    "stream_options",
    "ignore_eos",
    "priority",
    "tools",
    "user",
)

surrogates = st.sampled_from(["\ud800", "a\udfffb", "\ud83d", "x\udc00\ud800"])
texts = st.one_of(
    st.text(max_size=20),
    st.text(alphabet=st.characters(codec=None, exclude_categories=()), max_size=20),
    surrogates,
    st.tuples(st.text(max_size=10), surrogates).map("".join),
    st.integers(0, 20_000).map(lambda n: "ab" * n),  # up to 40 KB: over diptych-tiny's prompt limit
)
short_texts = st.one_of(st.text(alphabet=st.characters(codec=None, exclude_categories=()), max_size=20), surrogates)
scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(2**70), max_value=2**70),
    st.floats(allow_nan=True, allow_infinity=True),
    texts,
)
json_values = st.recursive(
    scalars,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(texts, inner, max_size=4),
    max_leaves=12,
)
nested = st.integers(1, 5_000).map(lambda depth: json.loads("[" * depth + "]" * depth) if depth < 500 else "[" * depth)
messages = st.lists(
    st.fixed_dictionaries(
        {},
        optional={
            "role": st.one_of(st.sampled_from(["system", "developer", "user", "assistant"]), json_values),
            "content": st.one_of(
                texts, json_values, st.lists(st.fixed_dictionaries({"type": st.just("text"), "text": texts}))
            ),
        },
    ),
    max_size=3,
)
field_values = {
    "model": st.one_of(st.just(MODEL), json_values),
    "prompt": st.one_of(texts, st.lists(st.integers(-5, 600), max_size=8), json_values, nested),
    "messages": st.one_of(messages, json_values, nested),
    "max_tokens": st.one_of(st.integers(-3, 2000), json_values),
    "temperature": st.one_of(st.floats(-1, 3), st.sampled_from([0, 1e-40, 1e-3, 0.01]), json_values),
    "top_p": st.one_of(st.floats(-1, 2), st.sampled_from([1e-40, 1e-4, 0.001]), json_values),
    "stop": st.one_of(texts, st.lists(texts, max_size=6), json_values),
    "stream": st.one_of(st.booleans(), json_values),
    "stream_options": st.one_of(st.fixed_dictionaries({"include_usage": st.booleans()}), json_values),
    "priority": st.one_of(st.sampled_from(["interactive", "batch"]), json_values),
}
VALID_BODY = {"model": MODEL, "prompt": "hello", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
# A valid body with one to three fields replaced: most examples get past the first check and reach the
# deeper ones (the protobuf translation, validation, tokenization).
TEXT_FIELDS = ("model", "prompt", "messages", "stop", "priority")  # where text reaches the protobuf and the tokenizer
mutated_bodies = (
    st.lists(st.sampled_from(FIELDS + TEXT_FIELDS * 4), min_size=1, max_size=3, unique=True)
    .flatmap(lambda names: st.fixed_dictionaries({name: field_values.get(name, json_values) for name in names}))
    .map(lambda changes: {**VALID_BODY, **changes})
)
bodies = st.one_of(
    mutated_bodies,
    mutated_bodies,
    st.fixed_dictionaries({}, optional={name: field_values.get(name, json_values) for name in FIELDS}),
    json_values,
)
raw_bodies = st.one_of(
    bodies.map(lambda body: json.dumps(body).encode()),  # NaN and Infinity included, as json.dumps writes them
    bodies.map(lambda body: json.dumps(body).encode()),
    st.binary(max_size=64),
)


@contextmanager
def running_gateway(tmp_path, batch_api: BatchApiProxy | None = None):
    """An in-process gateway on an event loop of the test's own, for hypothesis' synchronous examples."""
    with asyncio.Runner() as runner:
        context = in_process_gateway(tmp_path, batch_api=batch_api)
        gateway = runner.run(context.__aenter__())
        try:
            yield runner, gateway
        finally:
            runner.run(context.__aexit__(None, None, None))


async def _post(gateway, url: str, body: bytes, headers: dict):
    async with gateway.http.post(url, data=body, headers=headers) as response:
        return response.status, response.content_type, await response.read()


def _check_http_answer(status: int, content_type: str, raw: bytes) -> None:
    """A 4xx for what the door refuses; a request it lets through reaches routing, where the harness has no
    workers: 503, or an SSE stream that ends in its error event when streaming had started."""
    if status == 200 and content_type == "text/event-stream":
        assert b'"service_unavailable"' in raw and raw.endswith(b"data: [DONE]\n\n"), raw[-300:]
        return
    assert 400 <= status < 500 or status == 503, raw[:500]
    payload = json.loads(raw)
    assert_openai_error_shape(payload)
    if status == 503:
        assert payload["error"]["type"] == "service_unavailable", payload


def test_http_fuzz_never_gets_a_server_error(tmp_path):
    with running_gateway(tmp_path) as (runner, gateway):

        @FUZZ
        @example(
            body=b'{"model": "diptych-tiny", "prompt": "\\ud800"}',
            url="/v1/completions",  # once a 500
            authorization="Bearer dip_test_key",
            idempotency_key=None,
        )
        @example(
            body=b'{"model": "diptych-tiny", "prompt": "a", "priority": []}',
            url="/v1/completions",
            authorization="Bearer dip_test_key",
            idempotency_key="cl\u00e9",
        )
        @given(
            body=raw_bodies,
            url=st.sampled_from(["/v1/completions", "/v1/chat/completions"]),
            authorization=st.one_of(st.just("Bearer dip_test_key"), short_texts),
            idempotency_key=st.one_of(st.none(), st.sampled_from(["cl\u00e9", "tab\there", "\u00e9\u00e9"])),
        )
        def answer_is_never_a_server_error(body, url, authorization, idempotency_key):
            headers = {"Content-Type": "application/json", "Authorization": _header_safe(authorization)}
            if idempotency_key is not None:
                headers["Idempotency-Key"] = idempotency_key
            _check_http_answer(*runner.run(_post(gateway, url, body, headers)))

        answer_is_never_a_server_error()


def _header_safe(value: str) -> str:
    """What an HTTP client can send as a header value: no control characters that end the header line."""
    return "".join(c for c in value if c.isprintable() or c == " ").encode("utf-8", "surrogatepass").decode("latin-1")


valid_request = inference_pb2.GenerateRequest(model=MODEL, prompt="hello", max_tokens=2, stop=["x"]).SerializeToString()
grpc_payloads = st.one_of(
    st.binary(max_size=200),
    st.lists(st.tuples(st.integers(0, len(valid_request) - 1), st.integers(0, 255)), min_size=1, max_size=4).map(
        lambda flips: _flipped(valid_request, flips)
    ),
    st.builds(
        inference_pb2.GenerateRequest,
        model=st.one_of(st.just(MODEL), st.text(max_size=10)),
        prompt=st.text(max_size=50),
        max_tokens=st.integers(0, 2**32 - 1),
        temperature=st.floats(width=32),
        top_p=st.floats(width=32),
        top_k=st.integers(0, 2**32 - 1),
        seed=st.integers(0, 2**64 - 1),
        stop=st.lists(st.text(max_size=70), max_size=6),
        priority=st.integers(0, 5),
    ).map(lambda request: request.SerializeToString()),
)


def _flipped(payload: bytes, flips: list[tuple[int, int]]) -> bytes:
    mutated = bytearray(payload)
    for index, value in flips:
        mutated[index] = value
    return bytes(mutated)


def test_grpc_fuzz_is_never_unknown_or_internal(tmp_path):
    with running_gateway(tmp_path) as (runner, gateway):

        @FUZZ
        @given(payload=grpc_payloads)
        def status_is_never_unknown_or_internal(payload):
            code = runner.run(generate_raw(gateway, payload))
            assert code not in (grpc.StatusCode.UNKNOWN, grpc.StatusCode.INTERNAL), payload

        status_is_never_unknown_or_internal()


# The files and batches proxy, before the real control plane (a live Django server): whatever the path, the
# answer is never a server error, and every request the control plane receives is an operation the proxy
# serves, on an id of the control plane's format.

PATH_PIECES = [
    "..",
    ".",
    "%2e%2e",
    "%2E",
    "%2F",
    "%2f..%2F",
    "..%2F..%2Fv1%2Fapi-keys",
    "..%2F..%2Fv1%2Fapi-keys%23",
    "%00",
    "\x00",
    "%23",
    "%3F",
    "%5C..%5C",
    "%252F",
    "%",
    "%zz",
    ";",
    "",
    "file_abc",
    "file_abc%2F..",
    "batch_abc",
    "batch_abc%00",
    "file_" + "a" * 40,
    "content",
    "cancel",
    "api-keys",
]
path_segments = st.one_of(
    st.sampled_from(PATH_PIECES),
    st.text(max_size=12).map(lambda text: quote(text, safe="")),
    st.text(alphabet="./%0123456789abcdefABCDEF_?#;&=", max_size=12),
)
proxy_paths = st.builds(
    lambda prefix, segments, query: prefix + "".join("/" + segment for segment in segments) + query,
    st.sampled_from(["/v1/files", "/v1/batches"]),
    st.lists(path_segments, max_size=3),
    st.sampled_from(["", "?purpose=batch", "?after=..%2F..%2Fapi-keys%23", "?limit=%00", "?x=%2F"]),
)
SERVED = [  # (method, the control plane's path as its WSGI server decodes it)
    (method, re.compile("/api" + re.sub(r"\{(\w+)\}", lambda name: IDS[name.group(1)][1].pattern, path)))
    for method, path in ROUTES
]


def _served(method: str, path_info: str) -> bool:
    return any(method == served and pattern.fullmatch(path_info) for served, pattern in SERVED)


@contextmanager
def requests_reaching(control_plane_requests: list[tuple[str, str]]):
    """Records the method and path of every request the live control plane starts to answer."""

    def record(sender, environ, **kwargs) -> None:
        control_plane_requests.append((environ["REQUEST_METHOD"], environ["PATH_INFO"]))

    request_started.connect(record, weak=False)
    try:
        yield
    finally:
        request_started.disconnect(record)


def test_proxy_fuzz_reaches_only_the_operations_it_serves(live_server, tmp_path, transactional_db):
    organization = Organization.objects.create(name="Acme", slug="acme")
    api_key = api_key_create(organization=organization, name="owner", scopes=ALL_SCOPES).key
    reached: list[tuple[str, str]] = []
    proxy = BatchApiProxy(live_server.url)
    with running_gateway(tmp_path, batch_api=proxy) as (runner, gateway), requests_reaching(reached):

        @settings(FUZZ, max_examples=120)
        @example(method="GET", path="/v1/files/..%2F..%2Fv1%2Fapi-keys")  # once the caller's key list
        @example(method="POST", path="/v1/batches/..%2F..%2Fv1%2Fapi-keys%23/cancel")  # once a new API key
        @example(method="GET", path="/v1/files/%00")  # once a 500
        @given(method=st.sampled_from(["GET", "POST", "DELETE"]), path=proxy_paths)
        def answer_is_never_a_server_error(method, path):
            head = (
                f"{method} {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer {api_key}\r\n"
                "Content-Type: application/json\r\nContent-Length: 2\r\n"
            )
            status_and_headers, body = runner.run(raw_http(gateway, head.encode("latin-1"), b"{}"))
            status = int(status_and_headers.split(b" ", 2)[1])
            assert status < 500, (path, status_and_headers, body[:300])
            if status >= 400:
                assert "error" in json.loads(body), body[:300]
            assert all(_served(*request) for request in reached), (path, reached)

        answer_is_never_a_server_error()
        runner.run(proxy.close())
    assert reached, "no path reached the control plane: the check above saw nothing"
    assert list(ApiKey.objects.filter(organization=organization).values_list("name", flat=True)) == ["owner"]


# JSON inside a string field: a tool call's arguments (HTTP and gRPC), a json_schema and a tool's parameters
# (gRPC, where they are JSON text). Too deep or not JSON is a 400 / INVALID_ARGUMENT naming the field; JSON
# within bounds gets past the door or a 400 / INVALID_ARGUMENT naming the field; never a 500 or UNKNOWN.

MAX_STRING_FIELD_DEPTH = 64
depths = st.integers(1, 1_200)  # past 1,000 levels (once a RecursionError) and within the prompt's byte limit
json_texts = st.one_of(
    depths.map(lambda depth: "[" * depth + "]" * depth),
    depths.map(lambda depth: '{"a":' * depth + "1" + "}" * depth),
    depths.map(lambda depth: '{"a":[' * depth + "]}" * depth),
    depths.map(lambda depth: "[" * depth),
    st.text(alphabet='[]{}":,1a ', max_size=40),
    st.text(max_size=20),
    st.recursive(  # any JSON, its text short enough that the prompt's own limits never refuse it first
        st.one_of(st.none(), st.booleans(), st.integers(), st.floats(allow_nan=False), short_texts),
        lambda inner: st.lists(inner, max_size=4) | st.dictionaries(short_texts, inner, max_size=4),
        max_leaves=12,
    ).map(json.dumps),
    st.sampled_from(['{"type": "object", "properties": {}}', "{}", '{"x": 1}']),
)


def nesting(text: str) -> int | None:
    """How deep the JSON text nests, or None when it is not JSON; an empty text is an absent field."""
    if not text:
        return 0
    try:
        value = json.loads(text)
    except (ValueError, RecursionError):
        return None if text.count("[") + text.count("{") <= MAX_STRING_FIELD_DEPTH else 10**6
    deepest, stack = 0, [(value, 0)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, list | dict):
            deepest = max(deepest, depth + 1)
            stack += [(child, depth + 1) for child in (item.values() if isinstance(item, dict) else item)]
    return deepest


def _check_string_field_answer(text: str, refused: bool, message: str, field: str) -> None:
    depth = nesting(text)
    if depth is None or depth > MAX_STRING_FIELD_DEPTH:
        assert refused and field in message, (text[:80], message)
    elif refused:
        assert field in message, (text[:80], message)


def test_http_fuzz_of_tool_call_arguments_is_a_400_naming_them(tmp_path):
    with running_gateway(tmp_path) as (runner, gateway):

        @settings(FUZZ, max_examples=120)
        @example(arguments='{"a": "\\ud800"}')  # once a 500: the tokenizer refuses a lone surrogate
        @given(arguments=json_texts)
        def answer_names_the_arguments(arguments):
            call = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": arguments}}
            messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": None, "tool_calls": [call]}]
            body = json.dumps({"model": MODEL, "messages": messages, "max_tokens": 1}).encode()
            headers = {"Content-Type": "application/json", "Authorization": "Bearer dip_test_key"}
            status, content_type, raw = runner.run(_post(gateway, "/v1/chat/completions", body, headers))
            _check_http_answer(status, content_type, raw)
            message = json.loads(raw)["error"]["message"]
            assert status in (400, 503), raw[:300]
            _check_string_field_answer(arguments, status == 400, message, "messages[1].tool_calls")

        answer_names_the_arguments()


def _chat(*messages: inference_pb2.ChatMessage) -> inference_pb2.ChatMessages:
    return inference_pb2.ChatMessages(messages=[inference_pb2.ChatMessage(role="user", content="hi"), *messages])


GRPC_STRING_FIELDS = {  # the field's name in the error: the request holding `text` there
    "response_format.json_schema": lambda text: inference_pb2.GenerateRequest(
        prompt="hi", response_format=inference_pb2.ResponseFormat(type="json_schema", json_schema=text)
    ),
    "tools[0].function.parameters": lambda text: inference_pb2.GenerateRequest(
        chat=_chat(), tools=[inference_pb2.Tool(name="f", parameters=text)]
    ),
    "messages[1].tool_calls": lambda text: inference_pb2.GenerateRequest(
        chat=_chat(
            inference_pb2.ChatMessage(
                role="assistant", tool_calls=[inference_pb2.ToolCall(id="c", name="f", arguments=text)]
            )
        )
    ),
}


async def _generate_status(gateway, request: inference_pb2.GenerateRequest) -> tuple[grpc.StatusCode, str]:
    request.model, request.max_tokens = MODEL, 1
    call = gateway.channel.unary_stream("/diptych.v1.Inference/Generate")(
        request.SerializeToString(), metadata=(("authorization", "Bearer dip_test_key"),), timeout=10
    )
    try:
        async for _ in call:
            pass
    except grpc.aio.AioRpcError as error:
        return error.code(), error.details() or ""
    return await call.code(), ""


def test_grpc_fuzz_of_json_in_string_fields_is_invalid_argument_naming_them(tmp_path):
    with running_gateway(tmp_path) as (runner, gateway):

        @settings(FUZZ, max_examples=150)
        @example(field="messages[1].tool_calls", text='["\\udfff"]')
        @given(field=st.sampled_from(sorted(GRPC_STRING_FIELDS)), text=json_texts)
        def status_names_the_field(field, text):
            code, details = runner.run(_generate_status(gateway, GRPC_STRING_FIELDS[field](text)))
            assert code in (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.UNAVAILABLE), (code, details)
            _check_string_field_answer(text, code is grpc.StatusCode.INVALID_ARGUMENT, details, field)

        status_names_the_field()
