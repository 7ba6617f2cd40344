"""A bounded fuzz of the gateway's front doors, in process: random JSON bodies (wrong types, text that is
not Unicode, huge and deeply nested values) against the OpenAI-compatible endpoints, and random or
mutated bytes against gRPC Generate. Whatever arrives, the answer is a client error with the documented
shape, or, for a request the door lets through, the UNAVAILABLE of a fleet with no workers (the harness
has none): never a server error, never UNKNOWN or INTERNAL."""

import asyncio
import json
from contextlib import contextmanager

import grpc
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from diptych_proto.v1 import inference_pb2
from tests.gateway.harness import MODEL, assert_openai_error_shape, generate_raw, in_process_gateway

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
def running_gateway(tmp_path):
    """An in-process gateway on an event loop of the test's own, for hypothesis' synchronous examples."""
    with asyncio.Runner() as runner:
        context = in_process_gateway(tmp_path)
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
