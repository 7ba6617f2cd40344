"""The Messages API over a real colocated worker of the built-in model, in process, driven by the official
`anthropic` client: greedy answers equal to transformers generate, streams equal to the whole answers,
stop sequences, a tool use round trip, cache breakpoints and the cached tokens the platform reports, the
bill, idempotency keys, and a failure after the stream started."""

import json
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager

import anthropic
import jsonschema
import pytest

from diptych_common.builtin import DIPTYCH_TINY
from diptych_common.grammar import llguidance_tokenizer
from diptych_common.worker_credential import WorkerSecret
from gateway.anthropic_api.cache import shared_prefix_length
from gateway.fleet.channels import Channels
from gateway.planning import structured, tools
from gateway.planning.tokenization import tokenizer_for
from gateway.routing.route import ServingMode
from tests.gateway.harness import API_KEY, MODEL, ControlPlaneInMemory, in_process_gateway
from tests.workers.conftest import reference, tiny_model, wait_until  # noqa: F401 - the workers' fixtures
from tests.workers.serving import SECRET, Worker
from workers.serving.server import Role
from workers.structured.compiler import GrammarCompiler

WORKER_ID = "colocated-0"
GREEDY = {"temperature": 0}  # not a parameter of anthropic 2.15's create(): sent in the body as it is
SYSTEM = "You answer questions about the weather in the cities of northern Europe, briefly and in plain words."
QUESTION = [{"role": "user", "content": "What is the weather like in Oslo in spring?"}]
WEATHER = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 8}},
    "required": ["city"],
    "additionalProperties": False,
}
WEATHER_TOOL = {"name": "get_weather", "description": "today's weather in a city", "input_schema": WEATHER}


class ControlPlaneKeepingKeys(ControlPlaneInMemory):
    """The in-memory control plane, also keeping idempotency keys' answers (as the control plane's
    idempotency API does: a key claimed once, its stored answer given back to the next claim)."""

    def __init__(self, workers: list[dict]) -> None:
        super().__init__(workers=workers)
        self.answers: dict[str, dict] = {}

    async def claim_idempotency_key(self, body: dict) -> dict:
        stored = self.answers.get(body["key"])
        return {"outcome": "claimed"} if stored is None else {"outcome": "completed", "response": stored}

    async def complete_idempotency_key(self, body: dict) -> dict:
        self.answers[body["key"]] = body["response"]
        return {}

    async def release_idempotency_key(self, body: dict) -> dict:
        return {}


@asynccontextmanager
async def serving(tmp_path, tiny_model):  # noqa: F811 - the fixture, passed on
    """An in-process gateway over one colocated worker, and the official client pointed at it."""
    tokenizer = tokenizer_for(f"builtin:{MODEL}")
    grammars = GrammarCompiler(llguidance_tokenizer(tokenizer, DIPTYCH_TINY.llama_config["vocab_size"], frozenset()))
    with ThreadPoolExecutor(max_workers=1) as pool:
        worker = Worker(Role.COLOCATED, tiny_model, pool, allow_shm=False, grammars=grammars)
        await worker.start()
        entry = {"id": WORKER_ID, "role": "colocated", "model": MODEL, "region": "local", "address": worker.address}
        channels = Channels(WorkerSecret(SECRET))
        try:
            control_plane = ControlPlaneKeepingKeys(workers=[entry | {"state": "ready"}])
            async with in_process_gateway(tmp_path, control_plane, channels=channels, mode=ServingMode.COLOCATED) as gw:
                assert await wait_until(lambda: gw.path.board.is_fresh(WORKER_ID), timeout=10)
                base_url = str(gw.http.make_url("")).rstrip("/")
                async with anthropic.AsyncAnthropic(api_key=API_KEY, base_url=base_url, max_retries=0) as client:
                    yield gw, client
        finally:
            await channels.close()
            await worker.stop()


def prompt_ids(messages: list[dict]) -> list[int]:
    """The prompt as transformers renders the model's chat template and tokenizes it."""
    tokenizer = tokenizer_for(f"builtin:{MODEL}")
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def prompt_total(usage) -> int:
    return usage.input_tokens + usage.cache_creation_input_tokens + usage.cache_read_input_tokens


def billed(gateway) -> dict[str, dict[str, dict]]:
    """The usage events the gateway holds for the ledger: execution id -> phase -> event."""
    events: dict[str, dict[str, dict]] = {}
    for _, event in gateway.journal.oldest(1000):
        events.setdefault(event["request_id"], {})[event["phase"]] = event
    return events


async def test_a_greedy_message_equals_transformers_generate_and_counts_its_prompt(
    tmp_path,
    tiny_model,  # noqa: F811
    reference,  # noqa: F811
):
    async with serving(tmp_path, tiny_model) as (_, client):
        message = await client.messages.create(
            model=MODEL, max_tokens=12, system=SYSTEM, messages=QUESTION, extra_body=GREEDY
        )
        counted = await client.messages.count_tokens(model=MODEL, system=SYSTEM, messages=QUESTION)
    prompt = prompt_ids([{"role": "system", "content": SYSTEM}, *QUESTION])
    expected = tokenizer_for(f"builtin:{MODEL}").decode(reference(prompt, 12), skip_special_tokens=True)
    assert message.id.startswith("msg_") and message.type == "message" and message.role == "assistant"
    assert message.model == MODEL
    assert [block.type for block in message.content] == ["text"] and message.content[0].text == expected
    assert message.stop_reason == "max_tokens" and message.stop_sequence is None
    assert message.usage.output_tokens == 12
    assert prompt_total(message.usage) == len(prompt) == counted.input_tokens
    assert message.usage.cache_creation_input_tokens == 0  # no breakpoint: nothing asked to be cached


async def test_a_stream_carries_the_whole_answer_in_anthropic_s_events(tmp_path, tiny_model):  # noqa: F811
    async with serving(tmp_path, tiny_model) as (gateway, client):
        whole = await client.messages.create(model=MODEL, max_tokens=16, messages=QUESTION, extra_body=GREEDY)
        async with client.messages.stream(model=MODEL, max_tokens=16, messages=QUESTION, extra_body=GREEDY) as stream:
            streamed = "".join([text async for text in stream.text_stream])
            final = await stream.get_final_message()
        headers = {"x-api-key": API_KEY, "anthropic-version": "2023-06-01"}
        body = {"model": MODEL, "max_tokens": 16, "messages": QUESTION, "temperature": 0, "stream": True}
        async with gateway.http.post("/v1/messages", json=body, headers=headers) as response:
            raw = (await response.read()).decode()
    assert streamed == whole.content[0].text == final.content[0].text
    assert final.id.startswith("msg_") and final.id != whole.id
    assert (
        (final.stop_reason, final.usage.output_tokens)
        == (whole.stop_reason, whole.usage.output_tokens)
        == (
            "max_tokens",
            16,
        )
    )
    assert prompt_total(final.usage) == prompt_total(whole.usage)
    names = [block.split("\n")[0].removeprefix("event: ") for block in raw.strip().split("\n\n")]
    assert names[:3] == ["message_start", "ping", "content_block_start"]
    assert set(names[3:-3]) == {"content_block_delta"}
    assert names[-3:] == ["content_block_stop", "message_delta", "message_stop"]
    for block in raw.strip().split("\n\n"):
        name, data = block.split("\n")
        assert json.loads(data.removeprefix("data: "))["type"] == name.removeprefix("event: ")


async def test_a_stop_sequence_ends_the_answer_before_it_and_is_named(tmp_path, tiny_model):  # noqa: F811
    async with serving(tmp_path, tiny_model) as (_, client):
        whole = await client.messages.create(model=MODEL, max_tokens=24, messages=QUESTION, extra_body=GREEDY)
        text = whole.content[0].text
        start = next(i for i in range(2, len(text) - 1) if text[i : i + 2].isascii() and text[i : i + 2].isprintable())
        stop = text[start : start + 2]
        stopped = await client.messages.create(
            model=MODEL, max_tokens=24, messages=QUESTION, stop_sequences=["\x00never", stop], extra_body=GREEDY
        )
        async with client.messages.stream(
            model=MODEL, max_tokens=24, messages=QUESTION, stop_sequences=[stop], extra_body=GREEDY
        ) as stream:
            final = await stream.get_final_message()
    before = text[: text.find(stop)]
    assert (
        (stopped.stop_reason, stopped.stop_sequence)
        == (final.stop_reason, final.stop_sequence)
        == (
            "stop_sequence",
            stop,
        )
    )
    assert "".join(block.text for block in stopped.content) == before
    assert "".join(block.text for block in final.content) == before


async def test_a_tool_use_round_trip(tmp_path, tiny_model):  # noqa: F811
    async with serving(tmp_path, tiny_model) as (_, client):
        asked = await client.messages.create(
            model=MODEL,
            max_tokens=60,
            messages=QUESTION,
            tools=[WEATHER_TOOL],
            tool_choice={"type": "any"},
            extra_body=GREEDY,
        )
        async with client.messages.stream(
            model=MODEL,
            max_tokens=60,
            messages=QUESTION,
            tools=[WEATHER_TOOL],
            tool_choice={"type": "any"},
            extra_body=GREEDY,
        ) as stream:
            streamed = await stream.get_final_message()
        uses = [block for block in asked.content if block.type == "tool_use"]
        results = [{"type": "tool_result", "tool_use_id": use.id, "content": "sunny, 14 C"} for use in uses]
        conversation = [
            *QUESTION,
            {"role": "assistant", "content": asked.content},
            {"role": "user", "content": results},
        ]
        answered = await client.messages.create(
            model=MODEL, max_tokens=8, messages=conversation, tools=[WEATHER_TOOL], extra_body=GREEDY
        )
        counted = await client.messages.count_tokens(model=MODEL, messages=conversation, tools=[WEATHER_TOOL])
    assert asked.stop_reason == "tool_use" and uses
    for use in uses:
        assert use.id.startswith("toolu_") and use.name == "get_weather"
        jsonschema.validate(use.input, WEATHER)
    assert streamed.stop_reason == "tool_use"
    assert [(b.name, b.input) for b in streamed.content if b.type == "tool_use"] == [(u.name, u.input) for u in uses]
    assert answered.stop_reason in ("max_tokens", "end_turn", "tool_use")
    assert prompt_total(answered.usage) == counted.input_tokens


async def test_tool_choice_tool_calls_the_named_tool_and_none_calls_nothing(tmp_path, tiny_model):  # noqa: F811
    clock = {"name": "get_time", "input_schema": {"type": "object", "properties": {}, "additionalProperties": False}}
    async with serving(tmp_path, tiny_model) as (_, client):
        named = await client.messages.create(
            model=MODEL,
            max_tokens=60,
            messages=QUESTION,
            tools=[WEATHER_TOOL, clock],
            tool_choice={"type": "tool", "name": "get_time"},
            extra_body=GREEDY,
        )
        silent = await client.messages.create(
            model=MODEL,
            max_tokens=8,
            messages=QUESTION,
            tools=[WEATHER_TOOL],
            tool_choice={"type": "none"},
            extra_body=GREEDY,
        )
    assert named.stop_reason == "tool_use"  # Anthropic's, where the chat API's says "stop"
    assert {block.name for block in named.content if block.type == "tool_use"} == {"get_time"}
    assert [block.type for block in silent.content] == ["text"] and silent.stop_reason == "max_tokens"


CACHED_SYSTEM = " ".join(
    f"Rule {i}: answer about the weather of city number {i} in one short sentence." for i in range(6)
)


async def test_cache_breakpoints_report_what_was_written_and_read_and_the_bill_is_the_ledger_s(
    tmp_path,
    tiny_model,  # noqa: F811
):
    system = [{"type": "text", "text": CACHED_SYSTEM, "cache_control": {"type": "ephemeral"}}]
    ask = {"model": MODEL, "max_tokens": 4, "system": system, "messages": QUESTION, "extra_body": GREEDY}
    async with serving(tmp_path, tiny_model) as (gateway, client):
        first = await client.messages.create(**ask)
        second = await client.messages.create(**ask)
        headers = {"Authorization": f"Bearer {API_KEY}"}
        chat = {"model": MODEL, "max_tokens": 4, "temperature": 0,
                "messages": [{"role": "system", "content": CACHED_SYSTEM}, *QUESTION]}  # fmt: skip
        async with gateway.http.post("/v1/chat/completions", json=chat, headers=headers) as response:
            chat_usage = (await response.json())["usage"]
        ledger = billed(gateway)
    prompt = prompt_ids([{"role": "system", "content": CACHED_SYSTEM}, *QUESTION])
    marked = shared_prefix_length(prompt, prompt_ids([{"role": "system", "content": CACHED_SYSTEM}]))
    assert 32 <= marked < len(prompt)
    assert first.usage.cache_read_input_tokens == 0  # a fresh worker: nothing cached yet
    assert first.usage.cache_creation_input_tokens == marked
    assert first.usage.input_tokens == len(prompt) - marked
    read = second.usage.cache_read_input_tokens
    assert read >= 32  # the prompt's full blocks, from the prefix cache
    assert read == chat_usage["prompt_tokens_details"]["cached_tokens"]  # the figure the chat API reports
    assert second.usage.cache_creation_input_tokens == max(0, marked - read)
    assert prompt_total(second.usage) == len(prompt) == chat_usage["prompt_tokens"]
    for message in (first, second):
        events = ledger["exec_" + message.id.removeprefix("msg_")]
        assert events["prefill"]["tokens"] == prompt_total(message.usage)
        assert events["prefill"]["cached_tokens"] == message.usage.cache_read_input_tokens
        assert events["decode"]["tokens"] == message.usage.output_tokens


async def test_an_idempotency_key_replays_the_message_and_bills_it_once(tmp_path, tiny_model):  # noqa: F811
    ask = {"model": MODEL, "max_tokens": 6, "messages": QUESTION, "extra_body": GREEDY}
    key = {"Idempotency-Key": "anthropic-retry-1"}
    async with serving(tmp_path, tiny_model) as (gateway, client):
        first = await client.messages.with_raw_response.create(**ask, extra_headers=key)
        second = await client.messages.with_raw_response.create(**ask, extra_headers=key)
        async with client.messages.stream(**ask, extra_headers=key) as stream:
            replayed = await stream.get_final_message()
        ledger = billed(gateway)
    assert "Idempotent-Replayed" not in first.headers and second.headers["Idempotent-Replayed"] == "true"
    first_message, second_message = await first.parse(), await second.parse()
    assert first_message.id == second_message.id == replayed.id
    texts = [[block.text for block in message.content] for message in (first_message, second_message, replayed)]
    assert texts[0] == texts[1] == texts[2] and texts[0]
    assert first_message.usage == second_message.usage
    assert first.headers["request-id"] == "exec_" + first_message.id.removeprefix("msg_")
    assert list(ledger) == [first.headers["request-id"]]


async def test_a_failure_after_the_stream_started_is_an_error_event_the_client_raises(
    tmp_path,
    tiny_model,  # noqa: F811
    monkeypatch,
):
    """The door's schema checks undone, a tool whose schema only refers to itself reaches the worker, which
    fails the request after its prefill (tests/gateway/test_grammar_admission.py): the whole answer is a 500
    api_error, the stream's an `error` event, both in words of the kind and the request's id."""
    monkeypatch.setattr(structured, "grammar_problem", lambda grammar, model_source: None)
    monkeypatch.setattr(tools, "_own_document", tools.tool_parameters)
    broken = {"name": "f", "input_schema": {"$ref": "#"}}
    ask = {"model": MODEL, "max_tokens": 50, "messages": QUESTION, "tools": [broken], "tool_choice": {"type": "any"}}
    async with serving(tmp_path, tiny_model) as (_, client):
        with pytest.raises(anthropic.InternalServerError) as whole:
            await client.messages.create(**ask)
        with pytest.raises(anthropic.APIStatusError) as streamed:
            async with client.messages.stream(**ask) as stream:
                async for _ in stream.text_stream:
                    pass
    assert whole.value.status_code == 500 and whole.value.type == "api_error"
    assert whole.value.api_message.startswith("the request failed inside the platform; retry it")
    assert whole.value.request_id in whole.value.api_message
    assert streamed.value.status_code == 200  # the stream had started
    assert streamed.value.body["error"]["type"] == "api_error"
    assert streamed.value.body["request_id"] in streamed.value.body["error"]["message"]
    assert WORKER_ID not in streamed.value.body["error"]["message"]
