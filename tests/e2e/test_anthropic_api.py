"""Anthropic's Messages API on the live platform, driven by the official `anthropic` client, unchanged, with
base_url the gateway: greedy answers equal to transformers generate, streams, a tool use round trip,
count_tokens, the errors the client raises, cached tokens on a repeated prefix and what the ledger bills."""

import time
import uuid

import anthropic
import jsonschema
import pytest

from tests.e2e.test_gateway_limits import new_key
from tests.e2e.test_generation import generate_reference
from tests.e2e.test_metering import usage_events

MODEL = "diptych-tiny"
GREEDY = {"temperature": 0}  # not a parameter of anthropic 2.15's create(): sent in the body as it is
SYSTEM = "You answer questions about the weather in the cities of northern Europe, briefly and in plain words."
QUESTION = [{"role": "user", "content": "What is the weather like in Bergen in the autumn?"}]
WEATHER = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 8}},
    "required": ["city"],
    "additionalProperties": False,
}
WEATHER_TOOL = {"name": "get_weather", "description": "today's weather in a city", "input_schema": WEATHER}
ONE_CALL = {"type": "any", "disable_parallel_tool_use": True}  # a random model's list of calls may not end


def base_url(live, mode: str) -> str:
    return live.http_urls[mode].removesuffix("/v1")  # the client adds /v1/messages


@pytest.fixture(params=["split", "colocated"])
def mode(request) -> str:
    return request.param


@pytest.fixture
def client(live, mode):
    with anthropic.Anthropic(api_key=live.api_key, base_url=base_url(live, mode), max_retries=0) as client:
        yield client


def prompt_ids(tokenizer, messages: list[dict]) -> list[int]:
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def prompt_total(usage) -> int:
    return usage.input_tokens + usage.cache_creation_input_tokens + usage.cache_read_input_tokens


def test_a_greedy_message_equals_transformers_generate(client, reference):
    model, tokenizer = reference
    message = client.messages.create(model=MODEL, max_tokens=12, system=SYSTEM, messages=QUESTION, extra_body=GREEDY)
    prompt = prompt_ids(tokenizer, [{"role": "system", "content": SYSTEM}, *QUESTION])
    expected = generate_reference(model, prompt, 12)
    assert message.content[0].text == tokenizer.decode(expected, skip_special_tokens=True)
    assert message.stop_reason == ("max_tokens" if len(expected) == 12 else "end_turn")
    assert message.usage.output_tokens == len(expected)
    counted = client.messages.count_tokens(model=MODEL, system=SYSTEM, messages=QUESTION)
    assert prompt_total(message.usage) == len(prompt) == counted.input_tokens
    assert message.id.startswith("msg_")


def test_a_stream_gives_the_whole_answer(client):
    whole = client.messages.create(model=MODEL, max_tokens=20, messages=QUESTION, extra_body=GREEDY)
    with client.messages.stream(model=MODEL, max_tokens=20, messages=QUESTION, extra_body=GREEDY) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert text == "".join(block.text for block in whole.content) == "".join(block.text for block in final.content)
    assert (final.stop_reason, final.usage.output_tokens) == (whole.stop_reason, whole.usage.output_tokens)
    assert prompt_total(final.usage) == prompt_total(whole.usage)


def test_a_tool_use_round_trip(client):
    asked = client.messages.create(
        model=MODEL, max_tokens=200, messages=QUESTION, tools=[WEATHER_TOOL], tool_choice=ONE_CALL,
        extra_body=GREEDY,
    )  # fmt: skip
    uses = [block for block in asked.content if block.type == "tool_use"]
    assert asked.stop_reason == "tool_use" and len(uses) == 1
    for use in uses:
        jsonschema.validate(use.input, WEATHER)
    with client.messages.stream(
        model=MODEL, max_tokens=200, messages=QUESTION, tools=[WEATHER_TOOL], tool_choice=ONE_CALL,
        extra_body=GREEDY,
    ) as stream:  # fmt: skip
        streamed = stream.get_final_message()
    assert [(b.name, b.input) for b in streamed.content if b.type == "tool_use"] == [(u.name, u.input) for u in uses]
    results = [{"type": "tool_result", "tool_use_id": use.id, "content": "rain, 9 C"} for use in uses]
    conversation = [*QUESTION, {"role": "assistant", "content": asked.content}, {"role": "user", "content": results}]
    answered = client.messages.create(
        model=MODEL, max_tokens=8, messages=conversation, tools=[WEATHER_TOOL], extra_body=GREEDY
    )
    counted = client.messages.count_tokens(model=MODEL, messages=conversation, tools=[WEATHER_TOOL])
    assert answered.stop_reason in ("max_tokens", "end_turn", "tool_use")
    assert prompt_total(answered.usage) == counted.input_tokens


def test_a_repeated_prefix_reads_the_cache_and_the_ledger_bills_what_the_usage_says(live, client, mode):
    rules = " ".join(f"Rule {i}: answer about city number {i} in one sentence." for i in range(6))
    system = [{"type": "text", "text": f"{uuid.uuid4().hex} {rules}", "cache_control": {"type": "ephemeral"}}]
    ask = {"model": MODEL, "max_tokens": 4, "system": system, "messages": QUESTION, "extra_body": GREEDY}
    first = client.messages.create(**ask)
    second = client.messages.create(**ask)
    assert first.usage.cache_read_input_tokens == 0 and first.usage.cache_creation_input_tokens >= 32
    assert second.usage.cache_read_input_tokens >= 32
    assert second.usage.cache_creation_input_tokens == max(
        0, first.usage.cache_creation_input_tokens - second.usage.cache_read_input_tokens
    )
    assert prompt_total(first.usage) == prompt_total(second.usage)
    for message in (first, second):
        execution_id = "exec_" + message.id.removeprefix("msg_")
        events = {event["phase"]: event for event in usage_events(live, execution_id, expected=2)}
        assert events["prefill"]["tokens"] == prompt_total(message.usage)
        assert events["prefill"]["cached_tokens"] == message.usage.cache_read_input_tokens
        assert events["decode"]["tokens"] == message.usage.output_tokens
    live.wait_until_usage_sent(mode)  # nothing more arrives: each message billed once
    assert len(usage_events(live, "exec_" + second.id.removeprefix("msg_"), expected=3, seconds=0)) == 2


def test_an_idempotency_key_replays_the_message(live, client):
    key = {"Idempotency-Key": f"anthropic-{time.time_ns()}"}
    first = client.messages.with_raw_response.create(
        model=MODEL, max_tokens=5, messages=QUESTION, extra_body=GREEDY, extra_headers=key
    )
    second = client.messages.with_raw_response.create(
        model=MODEL, max_tokens=5, messages=QUESTION, extra_body=GREEDY, extra_headers=key
    )
    assert second.headers["Idempotent-Replayed"] == "true"
    assert first.parse().id == second.parse().id
    assert first.parse().usage == second.parse().usage


def test_the_client_raises_its_matching_exceptions(live):
    url = base_url(live, "split")
    with anthropic.Anthropic(api_key=live.api_key, base_url=url, max_retries=0) as client:
        with pytest.raises(anthropic.BadRequestError) as raised:
            client.messages.create(model=MODEL, max_tokens=4, messages=QUESTION, extra_body={"temperature": 3})
        assert raised.value.type == "invalid_request_error" and "temperature" in raised.value.api_message
        with pytest.raises(anthropic.BadRequestError, match="read text only"):
            image = {"type": "image", "source": {"type": "url", "url": "https://example.com/a.png"}}
            client.messages.create(model=MODEL, max_tokens=4, messages=[{"role": "user", "content": [image]}])
        with pytest.raises(anthropic.NotFoundError) as missing:
            client.messages.create(model="claude-9", max_tokens=4, messages=QUESTION)
        assert missing.value.type == "not_found_error"
    with (
        anthropic.Anthropic(api_key="dip_not-a-key", base_url=url, max_retries=0) as wrong,
        pytest.raises(anthropic.AuthenticationError),
    ):
        wrong.messages.create(model=MODEL, max_tokens=4, messages=QUESTION)
    limited_key = new_key(live, requests_per_minute=1)["key"]
    with anthropic.Anthropic(api_key=limited_key, base_url=url, max_retries=0) as limited:
        answered = limited.messages.with_raw_response.create(model=MODEL, max_tokens=2, messages=QUESTION)
        assert answered.headers["anthropic-ratelimit-requests-limit"] == "1"
        assert answered.headers["anthropic-ratelimit-requests-remaining"] == "0"
        with pytest.raises(anthropic.RateLimitError) as refused:
            limited.messages.create(model=MODEL, max_tokens=2, messages=QUESTION)
        assert int(refused.value.response.headers["retry-after"]) >= 1
    reader_key = new_key(live, scopes=("admin:read",))["key"]
    with (
        anthropic.Anthropic(api_key=reader_key, base_url=url, max_retries=0) as reader,
        pytest.raises(anthropic.PermissionDeniedError),
    ):
        reader.messages.create(model=MODEL, max_tokens=2, messages=QUESTION)
