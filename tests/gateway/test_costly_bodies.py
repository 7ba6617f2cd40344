"""Bodies that cost the gateway much per byte (hundreds of thousands of small values) are refused with a
clear error, and while they are read and refused the event loop keeps serving: the streams of other
tenants run on that loop, so a stall of it is a gap between their tokens. The loop's largest gap is
measured by a task ticking every 5 ms beside the request."""

import asyncio
import json
import threading
import time

import grpc
import pytest

from diptych_proto.v1 import inference_pb2, inference_pb2_grpc
from gateway.planning.json_body import INLINE_BODY_BYTES, MAX_BODY_VALUES
from tests.gateway.harness import API_KEY, MODEL, assert_openai_error_shape, in_process_gateway, post_json

# The loop's largest gap while a costly body is refused; its normal p99 gap between tokens is 0.05 to
# 0.08 s on the 2-core development machine, and these bodies stalled it for 1 to 2.5 s.
MAX_LOOP_GAP_S = 0.12


@pytest.fixture
async def gateway(tmp_path):
    async with in_process_gateway(tmp_path) as gateway:
        yield gateway


def _chat(**fields) -> dict:
    return {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], **fields}


def _schema(properties: int) -> dict:
    """A tool's parameters of about 60 KB."""
    fields = {f"field_{i}": {"type": "string", "description": "d" * 16} for i in range(properties)}
    return {"type": "object", "properties": fields}


def _tools(count: int, properties: int = 850) -> list[dict]:
    schema = _schema(properties)
    return [{"type": "function", "function": {"name": f"tool_{i}", "parameters": schema}} for i in range(count)]


COSTLY = [  # (body, param, part of the message)
    (
        {"model": MODEL, "messages": [{"role": "user", "content": [{"type": "text", "text": ""}] * 250_000}]},
        "messages",
        f"more than {MAX_BODY_VALUES} JSON values",
    ),
    ({"model": MODEL, "prompt": "a", "stop": [""] * 900_000}, "stop", f"more than {MAX_BODY_VALUES} JSON values"),
    (
        {"model": MODEL, "prompt": "a", "logit_bias": {str(i): 1 for i in range(400_000)}},
        "logit_bias",
        f"more than {MAX_BODY_VALUES} JSON values",
    ),
    (_chat(tools=_tools(128)), "tools", f"more than {MAX_BODY_VALUES} JSON values"),
    (_chat(tools=_tools(129, properties=10)), "tools", "tools holds 129 tools; send at most 128"),
    ({"model": MODEL, "prompt": "a", "stop": ["x"] * 5}, "stop", "stop holds 5 strings; send at most 4"),
    (
        {"model": MODEL, "prompt": "a", "logit_bias": {str(i): 1 for i in range(301)}},
        "logit_bias",
        "logit_bias holds 301 tokens; send at most 300",
    ),
    (
        {"model": MODEL, "messages": [{"role": "user", "content": [{"type": "text", "text": "a"}] * 1025}]},
        "messages",
        "messages[0].content holds 1025 parts; send at most 1024",
    ),
]


class LoopGaps:
    """The event loop's largest lag: a thread asks the loop every 5 ms to run a callback, which records how
    long it waited. (A task sleeping on the loop's own timers can miss a stall at the end of a request.)"""

    def __init__(self) -> None:
        self.largest = 0.0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def _record(self, sent: float) -> None:
        self.largest = max(self.largest, time.perf_counter() - sent)

    def _ask(self, loop: asyncio.AbstractEventLoop) -> None:
        while not self._stop.wait(0.005):
            loop.call_soon_threadsafe(self._record, time.perf_counter())

    async def __aenter__(self) -> "LoopGaps":
        self._thread = threading.Thread(target=self._ask, args=(asyncio.get_running_loop(),), daemon=True)
        self._thread.start()
        return self

    async def __aexit__(self, *exc) -> None:
        assert self._thread is not None
        self._stop.set()
        self._thread.join()
        await asyncio.sleep(0.02)  # the callbacks already asked for run


@pytest.mark.parametrize(("body", "param", "message"), COSTLY, ids=lambda value: None)
async def test_a_costly_body_is_refused_while_the_loop_keeps_serving(gateway, body, param, message):
    raw = json.dumps(body).encode()
    async with LoopGaps() as gaps:
        status, payload = await post_json(
            gateway, "/v1/chat/completions" if "messages" in body else "/v1/completions", raw
        )
    assert status == 400, payload
    assert_openai_error_shape(payload)
    assert message in payload["error"]["message"] and payload["error"]["param"] == param, payload
    # A loaded machine stretches every gap: the bound grows with what parsing the body on the loop would
    # cost here and now (a stall that long or longer is the defect itself).
    bound = max(MAX_LOOP_GAP_S, _seconds_to_parse(raw) / 2)
    assert gaps.largest < bound, f"the event loop stalled {gaps.largest:.2f} s on a {len(raw) >> 10} KB body"
    assert gateway.path.runs == 0


def _seconds_to_parse(raw: bytes) -> float:
    started = time.perf_counter()
    json.loads(raw)
    return time.perf_counter() - started


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"stop": [""] * 900_000}, "stop holds 900000 strings; send at most 4"),
        ({"logit_bias": {i: 1.0 for i in range(300_000)}}, "logit_bias holds 300000 tokens; send at most 300"),
        (
            {"tools": [inference_pb2.Tool(name=f"t{i}", parameters="{}") for i in range(129)]},
            "tools holds 129 tools; send at most 128",
        ),
    ],
)
async def test_grpc_refuses_the_same_counts_before_converting_them(gateway, fields, message):
    stub = inference_pb2_grpc.InferenceStub(gateway.channel)
    request = inference_pb2.GenerateRequest(model=MODEL, prompt="a", **fields)
    with pytest.raises(grpc.aio.AioRpcError) as raised:
        async for _ in stub.Generate(request, metadata=(("authorization", f"Bearer {API_KEY}"),)):
            pass
    assert raised.value.code() is grpc.StatusCode.INVALID_ARGUMENT
    assert message in raised.value.details()
    # How long the loop stalls on such a request is measured by `python -m bench.costly_bodies`, not here: a
    # bound on it failed under load (gRPC parses the message on the loop, whatever the handler does).
    assert gateway.path.runs == 0


async def test_a_large_valid_body_is_still_read(gateway):
    """A body over the inline size goes through the parser process and on to the workers (none here)."""
    raw = json.dumps({"model": MODEL, "prompt": "hello", "max_tokens": 1}).encode() + b" " * (INLINE_BODY_BYTES + 1)
    status, payload = await post_json(gateway, "/v1/completions", raw)
    assert status == 503 and payload["error"]["type"] == "service_unavailable", payload
    assert gateway.path.runs == 1
