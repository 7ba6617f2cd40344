"""The SDK's `client.responses` against a whole gateway in process over a real worker of the built-in model
(tests/gateway/responses_harness.py): create, stream, retrieve, delete, input_items and cancel answer the
SDK's typed objects, the sync and async clients alike, continuations report their cached tokens, and the
gateway's refusals come back as the SDK's typed errors. The sync client blocks, so it runs in a thread here
(the gateway's server runs on the test's event loop)."""

from __future__ import annotations

import asyncio
import json

import pytest

import diptych
from diptych.types import ResponseFunctionCall, ResponseMessage
from diptych_common.builtin import DIPTYCH_TINY
from diptych_common.grammar import llguidance_tokenizer
from gateway.planning.tokenization import tokenizer_for
from gateway.routing.route import ServingMode
from tests.gateway.harness import API_KEY, MODEL
from tests.gateway.responses_harness import OTHER_API_KEY, responses_gateway
from tests.workers.conftest import executor, tiny_model  # noqa: F401 - the workers' fixtures
from workers.serving.server import Role
from workers.structured.compiler import GrammarCompiler

COLOCATED = {"colocated-0": Role.COLOCATED}
WEATHER = {
    "type": "function",
    "name": "get_weather",
    "parameters": {
        "type": "object",
        "properties": {"unit": {"enum": ["C", "F"]}},
        "required": ["unit"],
        "additionalProperties": False,
    },
}


@pytest.fixture(autouse=True)
def _no_http_url_from_the_environment(monkeypatch):
    monkeypatch.delenv("DIPTYCH_HTTP_URL", raising=False)


@pytest.fixture(scope="module")
def grammars():
    tokenizer = tokenizer_for(f"builtin:{MODEL}")
    vocab = DIPTYCH_TINY.llama_config["vocab_size"]
    return GrammarCompiler(llguidance_tokenizer(tokenizer, vocab, frozenset({tokenizer.eos_token_id})))


@pytest.fixture
async def gateway(tmp_path, tiny_model, executor, grammars):  # noqa: F811
    async with responses_gateway(tmp_path, tiny_model, executor, COLOCATED, ServingMode.COLOCATED, grammars) as gw:
        yield gw


@pytest.fixture
async def client(gateway):
    async with diptych.AsyncClient(api_key=API_KEY, http_url=gateway.base_url, max_retries=0) as client:
        yield client


async def test_create_retrieve_and_delete_answer_typed_responses(gateway, client):
    response = await client.responses.create(
        model=MODEL, input="hello there", max_output_tokens=6, temperature=0, metadata={"topic": "x"}
    )
    assert isinstance(response, diptych.Response) and response.id.startswith("resp_")
    assert response.status in ("completed", "incomplete") and response.model == MODEL
    (message,) = response.output
    assert isinstance(message, ResponseMessage) and message.text == response.output_text
    assert response.usage.output_tokens <= 6 and response.usage.total_tokens == (
        response.usage.input_tokens + response.usage.output_tokens
    )
    assert response.metadata == {"topic": "x"} and response.store is True
    assert await client.responses.retrieve(response.id) == response
    items = await client.responses.input_items(response.id)
    assert [item.text for item in items.data] == ["hello there"]
    assert await client.responses.delete(response.id) is True
    with pytest.raises(diptych.NotFoundError):
        await client.responses.retrieve(response.id)


async def test_the_sync_client_does_the_same(gateway):
    def calls() -> tuple[diptych.Response, diptych.Response, list[str]]:
        with diptych.Client(api_key=API_KEY, http_url=gateway.base_url, max_retries=0) as client:
            first = client.responses.create(model=MODEL, input="one", max_output_tokens=4, temperature=0)
            with client.responses.stream(model=MODEL, input="one", max_output_tokens=4, temperature=0) as stream:
                kinds = [event.type for event in stream]
                streamed = stream.get_final_response()
            return first, streamed, kinds

    first, streamed, kinds = await asyncio.to_thread(calls)
    assert streamed.output_text == first.output_text and streamed.id != first.id
    assert kinds[0] == "response.created" and kinds[-1] in ("response.completed", "response.incomplete")


async def test_a_stream_yields_typed_events_and_its_final_response(client):
    stream = await client.responses.stream(model=MODEL, input="stream", max_output_tokens=5, temperature=0)
    async with stream:
        events = [event async for event in stream]
    final = events[-1].response
    assert [event.sequence_number for event in events] == list(range(len(events)))
    assert "".join(event.delta for event in events if event.type == "response.output_text.delta") == final.output_text
    assert (await client.responses.retrieve(final.id)).output_text == final.output_text


async def test_a_continuation_reports_its_cached_tokens(client):
    first = await client.responses.create(model=MODEL, input="a question " * 20, max_output_tokens=12, temperature=0)
    second = await client.responses.create(
        model=MODEL, previous_response_id=first.id, input="and more?", max_output_tokens=3, temperature=0
    )
    assert second.previous_response_id == first.id
    assert second.usage.cached_tokens >= (first.usage.total_tokens - 1) // 16 * 16 > 0


async def test_function_calls_come_back_typed(client):
    response = await client.responses.create(
        model=MODEL, input="weather?", tools=[WEATHER], tool_choice="required", max_output_tokens=60, temperature=0
    )
    (call,) = response.output
    assert isinstance(call, ResponseFunctionCall) and call.name == "get_weather" and response.output_text == ""


async def test_a_background_response_is_cancelled(client):
    queued = await client.responses.create(
        model=MODEL, input="go on", background=True, max_output_tokens=900, temperature=1, extra_body={"seed": 4}
    )
    assert queued.status == "queued" and queued.background
    cancelled = await client.responses.cancel(queued.id)
    assert cancelled.status == "cancelled" and (await client.responses.retrieve(queued.id)).status == "cancelled"


async def test_raw_responses_carry_the_request_id(client):
    raw = await client.responses.with_raw_response.create(model=MODEL, input="hi", max_output_tokens=2)
    assert raw.request_id and raw.parse().id == "resp_" + raw.request_id.removeprefix("exec_")


async def test_refusals_are_the_sdks_typed_errors(gateway, client):
    with pytest.raises(diptych.BadRequestError, match="web_search"):
        await client.responses.create(model=MODEL, input="x", tools=[{"type": "web_search"}])  # type: ignore[list-item]
    with pytest.raises(diptych.NotFoundError):
        await client.responses.create(model="no-such-model", input="x")
    response = await client.responses.create(model=MODEL, input="mine", max_output_tokens=2)
    async with diptych.AsyncClient(api_key=OTHER_API_KEY, http_url=gateway.base_url, max_retries=0) as other:
        with pytest.raises(diptych.NotFoundError):
            await other.responses.retrieve(response.id)
    with pytest.raises(diptych.AuthenticationError):
        async with diptych.AsyncClient(api_key="wrong", http_url=gateway.base_url, max_retries=0) as stranger:
            await stranger.responses.retrieve(response.id)


def test_http_url_is_checked_and_read_from_the_environment(monkeypatch):
    with pytest.raises(ValueError, match="http_url"):
        diptych.Client(api_key="k", http_url="ftp://gateway")
    monkeypatch.setenv("DIPTYCH_HTTP_URL", "https://gateway.example.com/v1/")
    with diptych.Client(api_key="k") as client:
        assert client.http_url == "https://gateway.example.com/v1"


async def test_a_streaming_response_gives_the_events_line_by_line(client):
    arguments = {"model": MODEL, "input": "lines", "max_output_tokens": 3, "temperature": 0, "extra_query": {}}
    async with client.responses.with_streaming_response.stream(**arguments) as response:
        assert response.status_code == 200 and response.headers["content-type"].startswith("text/event-stream")
        assert response.request_id
        lines = [line async for line in response.iter_lines()]
    events = [json.loads(line.removeprefix("data:")) for line in lines if line.startswith("data:")]
    assert events[0]["type"] == "response.created"
    assert events[-1]["type"] in ("response.completed", "response.incomplete")
    async with client.responses.with_streaming_response.stream(**arguments) as response:
        stream = await response.parse()
        final = await stream.get_final_response()
    assert final.output_text == events[-1]["response"]["output"][0]["content"][0]["text"]


async def test_a_streaming_response_of_a_stored_response_parses_to_it(client):
    created = await client.responses.create(model=MODEL, input="keep", max_output_tokens=2, temperature=0)
    async with client.responses.with_streaming_response.retrieve(created.id, extra_headers={"X-Trace": "t"}) as raw:
        assert raw.headers["content-type"].startswith("application/json")
        assert await raw.parse() == created
