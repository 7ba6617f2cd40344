"""The SDK against a scripted in-process gRPC server (see sdk_scripted_server.py)."""

from __future__ import annotations

import asyncio
import time
import uuid

import grpc
import pytest
from sdk_scripted_server import (
    endless,
    fail,
    final_without_usage,
    request_id_of,
    silent_after,
    stored,
    tokens,
    unfinished,
)

import diptych
from diptych_proto.v1 import inference_pb2 as pb

HELLO = tokens(("Hel", [1, 2]), ("lo", [3]))
RETRY_NOW = (("retry-after-ms", "0"),)


# A call's deadline, far beyond every wait below: a call that ends within CANCEL_SEEN_S ended because the SDK
# cancelled it, not because its deadline passed.
CALL_TIMEOUT_S = 60
CANCEL_SEEN_S = 5


@pytest.fixture
def client(server):
    with diptych.Client(api_key="sk-test", base_url=server.base_url, timeout=CALL_TIMEOUT_S, max_retries=2) as client:
        yield client


@pytest.fixture
async def async_client(server):
    async with diptych.AsyncClient(
        api_key="sk-test", base_url=server.base_url, timeout=CALL_TIMEOUT_S, max_retries=2
    ) as client:
        yield client


def test_completion(server, client):
    server.servicer.script = [HELLO]
    completion = client.completions.create(model="m", prompt="Say hello", max_tokens=4, temperature=0)
    assert (completion.text, completion.token_ids, completion.finish_reason) == ("Hello", [1, 2, 3], "stop")
    assert completion.model == "m"
    assert completion.usage.total_tokens == 7 and completion.usage.prefill.worker_id == "prefill-0"
    usage = completion.usage
    assert (usage.prompt_tokens, usage.completion_tokens, usage.cached_tokens) == (5, 2, 1)
    request = server.servicer.requests[0]
    assert completion.id == request_id_of(request)
    assert uuid.UUID(request.idempotency_key) and request.request_id == ""
    assert request.prompt == "Say hello" and request.max_tokens == 4 and request.HasField("temperature")
    assert (request.priority, request.ignore_eos) == (pb.PRIORITY_INTERACTIVE, False)
    assert server.servicer.metadata[0]["authorization"] == "Bearer sk-test"


def test_priority_and_ignore_eos_are_sent(server, client):
    server.servicer.script = [HELLO]
    client.completions.create(model="m", prompt="x", priority="batch", ignore_eos=True)
    client.chat.completions.create(model="m", messages=[{"role": "user", "content": "Hi"}], priority="interactive")
    first, second = server.servicer.requests
    assert (first.priority, first.ignore_eos) == (pb.PRIORITY_BATCH, True)
    assert (second.priority, second.ignore_eos) == (pb.PRIORITY_INTERACTIVE, False)


@pytest.mark.parametrize("options", [{"priority": "urgent"}, {"idempotency_key": ""}, {"idempotency_key": "k" * 256}])
def test_bad_options_are_refused_before_sending(server, client, options):
    with pytest.raises(ValueError):
        client.completions.create(model="m", prompt="x", **options)
    assert server.servicer.requests == []


def test_stream(server, client):
    server.servicer.script = [HELLO]
    with client.completions.create(model="m", prompt=[5, 6], stream=True, idempotency_key="order-42") as stream:
        assert stream.usage is None
        chunks = list(stream)
    request = server.servicer.requests[0]
    assert request.idempotency_key == "order-42"
    request_id = request_id_of(request)
    assert [(c.id, c.text, c.token_ids, c.finish_reason) for c in chunks] == [
        (request_id, "Hel", [1, 2], None),
        (request_id, "lo", [3], "stop"),
    ]
    assert chunks[0].usage is None and chunks[1].usage.completion_tokens == 2
    assert stream.usage == chunks[1].usage and stream.request_id == request_id
    assert list(request.prompt_token_ids.ids) == [5, 6]


def test_each_create_has_its_own_idempotency_key(server, client):
    server.servicer.script = [HELLO]
    for _ in range(3):
        client.completions.create(model="m", prompt="x")
    assert len({request.idempotency_key for request in server.servicer.requests}) == 3


def test_chat_uses_the_chat_input(server, client):
    server.servicer.script = [HELLO]
    messages = [{"role": "user", "content": "Hi"}]
    completion = client.chat.completions.create(model="m", messages=messages, stop="\n")
    assert completion.text == "Hello"
    request = server.servicer.requests[0]
    assert request.WhichOneof("input") == "chat" and list(request.stop) == ["\n"]


def test_models_list(server, client):
    server.servicer.models = [pb.Model(id="qwen", context_length=4096, has_chat_template=True)]
    page = client.models.list()
    assert isinstance(page, diptych.Page) and (page.has_more, page.total, page.has_next_page()) == (False, 1, False)
    assert page.data == list(page) == [diptych.Model(id="qwen", context_length=4096, has_chat_template=True)]
    assert server.servicer.metadata[0]["authorization"] == "Bearer sk-test"


def test_breaking_out_of_a_stream_cancels_the_call(server, client):
    server.servicer.script = [endless]
    stream = client.completions.create(model="m", prompt="x", stream=True)
    for chunk in stream:
        assert chunk.text == "x"
        break
    assert server.servicer.call_ended.wait(CANCEL_SEEN_S)


def test_closing_a_stream_cancels_the_call(server, client):
    server.servicer.script = [endless]
    with client.completions.create(model="m", prompt="x", stream=True) as stream:
        next(stream)
    assert server.servicer.call_ended.wait(CANCEL_SEEN_S)
    assert list(stream) == []


def test_retries_reuse_the_idempotency_key(server, client):
    server.servicer.script = [
        fail(grpc.StatusCode.UNAVAILABLE, "no decode worker", RETRY_NOW),
        fail(grpc.StatusCode.RESOURCE_EXHAUSTED, "queue full", RETRY_NOW),
        HELLO,
    ]
    completion = client.completions.create(model="m", prompt="x")
    assert completion.text == "Hello"
    keys = {request.idempotency_key for request in server.servicer.requests}
    assert len(server.servicer.requests) == 3 and len(keys) == 1
    assert completion.id == request_id_of(server.servicer.requests[0])


def test_retries_stop_at_max_retries(server, client):
    server.servicer.script = [fail(grpc.StatusCode.RESOURCE_EXHAUSTED, "queue full", (("retry-after-ms", "10"),))]
    with pytest.raises(diptych.RateLimitError) as raised:
        client.completions.create(model="m", prompt="x", idempotency_key="limited")
    assert len(server.servicer.requests) == 3
    error = raised.value
    assert (error.retry_after, error.idempotency_key) == (0.01, "limited")
    assert error.request_id == request_id_of(server.servicer.requests[0])


def test_client_errors_are_not_retried(server, client):
    server.servicer.script = [fail(grpc.StatusCode.INVALID_ARGUMENT, "max_tokens exceeds the context")]
    with pytest.raises(diptych.BadRequestError, match="max_tokens exceeds the context") as raised:
        client.completions.create(model="m", prompt="x", stream=True)
    assert len(server.servicer.requests) == 1
    assert raised.value.request_id == request_id_of(server.servicer.requests[0])


def test_no_retry_once_output_was_received(server, client):
    server.servicer.script = [fail(grpc.StatusCode.UNAVAILABLE, "decode worker lost", RETRY_NOW, after=2)]
    stream = client.completions.create(model="m", prompt="x", stream=True)
    texts = []
    with pytest.raises(diptych.ServiceUnavailableError, match="decode worker lost") as raised:
        for chunk in stream:
            texts.append(chunk.text)
    assert texts == ["t0", "t1"]
    assert raised.value.request_id == stream.request_id is not None
    with pytest.raises(diptych.ServiceUnavailableError):
        client.completions.create(model="m", prompt="x")
    assert len(server.servicer.requests) == 2


@pytest.mark.parametrize("status", [s for s in grpc.StatusCode if s is not grpc.StatusCode.OK], ids=lambda s: s.name)
def test_every_status_from_the_server_is_mapped(server, client, status):
    server.servicer.script = [fail(status, "scripted", after=1)]
    stream = client.with_options(max_retries=0).completions.create(model="m", prompt="x", stream=True)
    with pytest.raises(diptych.DiptychError) as raised:
        list(stream)
    assert raised.value.code == status.name and raised.value.message == "scripted"
    assert not isinstance(raised.value, grpc.RpcError)


@pytest.mark.parametrize("handler", [unfinished, final_without_usage], ids=["no final message", "no usage"])
def test_stream_ending_without_usage_is_refused(server, client, handler):
    server.servicer.script = [handler]
    with pytest.raises(diptych.APIResponseValidationError):
        client.completions.create(model="m", prompt="x")


def test_deadline_is_a_timeout_and_not_retried(server, client):
    server.servicer.script = [endless]
    with pytest.raises(diptych.APITimeoutError):
        client.completions.create(model="m", prompt="x", timeout=0.3)
    assert len(server.servicer.requests) == 1


@pytest.mark.parametrize("silent_from", [0, 2], ids=["before the first token", "mid-stream"])
def test_silent_stream_times_out_and_is_cancelled(server, client, silent_from):
    server.servicer.script = [silent_after(silent_from)]
    quick = client.with_options(stream_idle_timeout=0.3)
    received = []
    started = time.monotonic()
    with (
        pytest.raises(diptych.APITimeoutError, match="stream_idle_timeout") as raised,
        quick.completions.create(model="m", prompt="x", stream=True) as stream,
    ):
        received.extend(chunk.text for chunk in stream)
    assert time.monotonic() - started < CANCEL_SEEN_S, "the SDK waited for the call's deadline, not its idle timeout"
    assert received == [f"t{index}" for index in range(silent_from)]
    assert raised.value.idempotency_key == server.servicer.requests[0].idempotency_key
    assert server.servicer.call_ended.wait(CANCEL_SEEN_S)
    assert len(server.servicer.requests) == 1


def test_a_slow_reader_is_not_an_idle_stream(server, client):
    server.servicer.script = [HELLO]
    with client.with_options(stream_idle_timeout=0.2).completions.create(model="m", prompt="x", stream=True) as stream:
        first = next(stream)
        time.sleep(0.5)  # the caller's own work between chunks: the gateway's answer is already buffered
        rest = list(stream)
    assert [first.text, *(chunk.text for chunk in rest)] == ["Hel", "lo"]


async def test_async_completion_and_chat(server, async_client):
    server.servicer.script = [HELLO]
    completion = await async_client.completions.create(model="m", prompt="x")
    assert (completion.text, completion.usage.total_tokens) == ("Hello", 7)
    chat = await async_client.chat.completions.create(
        model="m", messages=[{"role": "user", "content": "Hi"}], priority="batch"
    )
    assert chat.token_ids == [1, 2, 3]
    assert server.servicer.requests[1].WhichOneof("input") == "chat"
    assert server.servicer.requests[1].priority == pb.PRIORITY_BATCH
    assert server.servicer.metadata[1]["authorization"] == "Bearer sk-test"


async def test_async_stream(server, async_client):
    server.servicer.script = [HELLO]
    async with await async_client.completions.create(model="m", prompt="x", stream=True) as stream:
        chunks = [chunk async for chunk in stream]
    assert [chunk.finish_reason for chunk in chunks] == [None, "stop"]
    assert stream.usage.prompt_tokens == 5 and stream.request_id == chunks[0].id


async def test_async_break_cancels_the_call(server, async_client):
    server.servicer.script = [endless]
    stream = await async_client.completions.create(model="m", prompt="x", stream=True)
    async for _ in stream:
        break
    assert await asyncio.to_thread(server.servicer.call_ended.wait, CANCEL_SEEN_S)


async def test_async_retries_then_mid_stream_error(server, async_client):
    server.servicer.script = [
        fail(grpc.StatusCode.UNAVAILABLE, "warming up", RETRY_NOW),
        fail(grpc.StatusCode.INTERNAL, "worker crashed", after=1),
    ]
    stream = await async_client.completions.create(model="m", prompt="x", stream=True)
    with pytest.raises(diptych.InternalServerError, match="worker crashed"):
        async for _ in stream:
            pass
    assert len({request.idempotency_key for request in server.servicer.requests}) == 1
    assert len(server.servicer.requests) == 2


@pytest.mark.parametrize("silent_from", [0, 1], ids=["before the first token", "mid-stream"])
async def test_async_silent_stream_times_out_and_is_cancelled(server, async_client, silent_from):
    server.servicer.script = [silent_after(silent_from)]
    quick = async_client.with_options(stream_idle_timeout=0.3)
    with pytest.raises(diptych.APITimeoutError, match="stream_idle_timeout"):
        async with await quick.completions.create(model="m", prompt="x", stream=True) as stream:
            async for _ in stream:
                pass
    assert await asyncio.to_thread(server.servicer.call_ended.wait, CANCEL_SEEN_S)
    assert len(server.servicer.requests) == 1


async def test_async_models_list(server, async_client):
    server.servicer.models = [pb.Model(id="a", context_length=1), pb.Model(id="b", context_length=2)]
    page = await async_client.models.list()
    assert isinstance(page, diptych.AsyncPage) and [model.id for model in page.data] == ["a", "b"]
    assert [model.id async for model in page] == ["a", "b"]


# What grpcio's client reports when the gateway's connection breaks mid-stream.
CONNECTION_CUT = (grpc.StatusCode.UNAVAILABLE, "Socket closed")


def test_a_stream_cut_mid_way_is_resumed_with_what_its_execution_handed_over(server, client):
    server.servicer.script = [
        fail(*CONNECTION_CUT, after=2),
        fail(grpc.StatusCode.ABORTED, "a request with this idempotency key is still running"),
        stored("t0t1t2", [0, 1, 2]),
    ]
    stream = client.completions.create(model="m", prompt="x", stream=True)
    chunks = list(stream)
    assert [(c.text, c.token_ids, c.finish_reason) for c in chunks] == [
        ("t0", [0], None),
        ("t1", [1], None),
        ("t2", [2], "interrupted"),
    ]
    assert stream.usage is not None and stream.usage.completion_tokens == 2
    first, *resumes = server.servicer.requests
    assert [r.resume_request_id for r in resumes] == [stream.request_id] * 2 and not first.resume_request_id
    assert {r.idempotency_key for r in resumes} == {first.idempotency_key}


def test_a_cut_stream_whose_answer_was_not_stored_raises_a_clear_retryable_error(server, client):
    server.servicer.script = [
        fail(*CONNECTION_CUT, after=2),
        fail(grpc.StatusCode.NOT_FOUND, "nothing of request x is stored under this idempotency key"),
    ]
    stream = client.completions.create(model="m", prompt="x", stream=True)
    texts = []
    with pytest.raises(diptych.StreamInterruptedError, match="cut after 2 tokens") as raised:
        for chunk in stream:
            texts.append(chunk.text)
    assert texts == ["t0", "t1"] and raised.value.code == "UNAVAILABLE"
    assert "Send the request again under a new idempotency key" in raised.value.message
    assert isinstance(raised.value, diptych.APIConnectionError)


def test_a_stored_answer_that_does_not_continue_the_stream_is_refused(server, client):
    server.servicer.script = [fail(*CONNECTION_CUT, after=2), stored("other text", [9, 9, 9])]
    with pytest.raises(diptych.APIResponseValidationError, match="does not continue what was streamed"):
        list(client.completions.create(model="m", prompt="x", stream=True))


async def test_an_async_stream_cut_mid_way_is_resumed(server, async_client):
    server.servicer.script = [fail(*CONNECTION_CUT, after=1), stored("t0t1", [0, 1])]
    stream = await async_client.completions.create(model="m", prompt="x", stream=True)
    chunks = [chunk async for chunk in stream]
    assert [(c.text, c.finish_reason) for c in chunks] == [("t0", None), ("t1", "interrupted")]
    assert server.servicer.requests[1].resume_request_id == stream.request_id


def test_a_retry_goes_to_the_next_gateway(server, closed_port):
    server.servicer.script = [HELLO]
    base_url = f"grpc://127.0.0.1:{closed_port},{server.base_url.removeprefix('grpc://')}"
    with diptych.Client(api_key="sk-test", base_url=base_url, timeout=CALL_TIMEOUT_S, max_retries=1) as client:
        for _ in range(4):  # whichever gateway a call starts on, its retry reaches the live one
            assert client.completions.create(model="m", prompt="x").text == "Hello"


async def test_an_async_client_passes_over_a_gateway_failing_to_connect(server, closed_port):
    server.servicer.script = [HELLO]
    base_url = f"grpc://127.0.0.1:{closed_port},{server.base_url.removeprefix('grpc://')}"
    async with diptych.AsyncClient(api_key="sk-test", base_url=base_url, max_retries=0) as client:
        outcomes = []
        for _ in range(6):
            try:
                outcomes.append((await client.completions.create(model="m", prompt="x")).text)
            except diptych.APIConnectionError:
                outcomes.append("refused")
    assert outcomes.count("refused") <= 1 and outcomes[1:] == ["Hello"] * 5, outcomes
