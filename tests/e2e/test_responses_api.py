"""OpenAI's Responses API on the live platform, driven by the official `openai` client unchanged: a response
equal to `transformers` generate, streamed, retrieved, listed and deleted; a function call answered and
continued; json_schema output; a continuation (previous_response_id) whose prompt is the stored conversation's
token ids extended, its prefix-cache hit exactly the conversation's whole blocks and billed as cached; store
false keeping nothing; a background response cancelled; another organization's ids answered 404."""

import json

import jsonschema
import openai
import pytest

from tests.e2e.test_generation import generate_reference
from tests.e2e.waiting import wait_for

MODEL = "diptych-tiny"
BLOCK = 16
EOS = 1
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
ANSWER = {
    "type": "object",
    "properties": {"answer": {"enum": ["yes", "no"]}},
    "required": ["answer"],
    "additionalProperties": False,
}
QUESTION = "How does a prefix cache keep the blocks of a conversation between its turns? " * 2


@pytest.fixture(params=["split", "colocated"])
def mode(request) -> str:
    return request.param


@pytest.fixture
def client(live, mode):
    with openai.OpenAI(api_key=live.api_key, base_url=live.http_urls[mode], max_retries=0) as client:
        yield client


def stored(live, response_id: str) -> dict:
    """The response as the control plane keeps it, token ids included."""
    with live.internal() as internal:
        answer = internal.get(f"/responses/{response_id}", params={"organization_id": live.credentials.organization_id})
    answer.raise_for_status()
    return answer.json()


def token_ids(live, response_id: str) -> tuple[list[int], list[int]]:
    body = stored(live, response_id)
    return body["prompt_token_ids"], body["output_token_ids"]


def test_a_response_equals_generate_and_comes_back_stored(live, client, reference):
    model, tokenizer = reference
    response = client.responses.create(model=MODEL, input="tell me about caches", max_output_tokens=10, temperature=0)
    prompt, output = token_ids(live, response.id)
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": "tell me about caches"}], add_generation_prompt=True, tokenize=False
    )
    assert prompt == tokenizer(text, add_special_tokens=False)["input_ids"]
    assert output == generate_reference(model, prompt, 10)[: len(output)]
    assert response.output_text == tokenizer.decode(output, skip_special_tokens=True)
    assert (response.usage.input_tokens, response.usage.output_tokens) == (len(prompt), len(output))
    assert client.responses.retrieve(response.id).model_dump() == response.model_dump()
    items = client.responses.input_items.list(response.id)
    assert [item.type for item in items.data] == ["message"] and items.data[0].content[0].text == "tell me about caches"
    client.responses.delete(response.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(response.id)


def test_a_streamed_response_is_the_whole_one(client):
    text = {"format": {"type": "json_schema", "name": "answer", "schema": ANSWER, "strict": True}}
    asked = {"model": MODEL, "input": "yes or no?", "max_output_tokens": 40, "temperature": 0, "text": text}
    whole = client.responses.create(**asked)
    jsonschema.validate(json.loads(whole.output_text), ANSWER)
    with client.responses.stream(**asked) as stream:
        kinds = [event.type for event in stream]
        final = stream.get_final_response()
    assert kinds[:2] == ["response.created", "response.in_progress"] and kinds[-1] == "response.completed"
    assert final.output_text == whole.output_text
    assert client.responses.retrieve(final.id).output_text == whole.output_text


def test_a_function_call_round_trip(live, client):
    called = client.responses.create(
        model=MODEL, input="the weather?", tools=[WEATHER], tool_choice="required", max_output_tokens=60, temperature=0
    )
    (call,) = called.output
    assert call.type == "function_call" and json.loads(call.arguments)["unit"] in ("C", "F")
    answered = client.responses.create(
        model=MODEL,
        previous_response_id=called.id,
        tools=[WEATHER],
        tool_choice="none",
        input=[{"type": "function_call_output", "call_id": call.call_id, "output": "rain"}],
        max_output_tokens=6,
        temperature=0,
    )
    assert answered.output[0].type == "message" and answered.previous_response_id == called.id
    called_prompt, called_output = token_ids(live, called.id)
    answered_prompt, _ = token_ids(live, answered.id)
    assert answered_prompt[: len(called_prompt) + len(called_output)] == called_prompt + called_output


def test_a_continuation_hits_the_cache_for_the_whole_conversation_and_is_billed_cached(live, client, mode, reference):
    model, _ = reference
    first = client.responses.create(model=MODEL, input=QUESTION, max_output_tokens=24, temperature=0)
    second = client.responses.create(
        model=MODEL, previous_response_id=first.id, input="and between gateways?", max_output_tokens=6, temperature=0
    )
    first_prompt, first_output = token_ids(live, first.id)
    second_prompt, second_output = token_ids(live, second.id)
    conversation = first_prompt + first_output
    assert second_prompt[: len(conversation)] == conversation
    # The worker that served the first turn holds the whole conversation but its last output token (never fed
    # back); routed there, the second turn's prompt hits its whole blocks, split or colocated.
    cached = second.usage.input_tokens_details.cached_tokens
    assert cached == (len(conversation) - 1) // BLOCK * BLOCK > 0
    assert second_output == generate_reference(model, second_prompt, 6)[: len(second_output)]
    execution = "exec_" + second.id.removeprefix("resp_")
    live.wait_until_usage_sent(mode)
    with live.rest() as rest:
        events = rest.get("/usage-events", params={"request_id": execution}).json()["data"]
    prefill = [event for event in events if event["phase"] == "prefill"]
    assert [(e["tokens"], e["cached_tokens"]) for e in prefill] == [(len(second_prompt), cached)]


def test_store_false_keeps_nothing(live, client):
    response = client.responses.create(model=MODEL, input="forget me", store=False, max_output_tokens=3)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(response.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.create(model=MODEL, previous_response_id=response.id, input="again")
    with live.internal() as internal:
        answer = internal.get(f"/responses/{response.id}", params={"organization_id": live.credentials.organization_id})
    assert answer.status_code == 404


def test_a_background_response_is_cancelled(live, client):
    queued = client.responses.create(
        model=MODEL, input="go on", background=True, max_output_tokens=900, temperature=1, extra_body={"seed": 5}
    )
    assert queued.status == "queued"
    assert wait_for(lambda: client.responses.retrieve(queued.id).status != "queued", 20, interval=0.02)
    cancelled = client.responses.cancel(queued.id)
    assert cancelled.status == "cancelled"
    assert wait_for(lambda: token_ids(live, queued.id)[1], 10)  # the run stored what it produced
    _, output = token_ids(live, queued.id)
    assert 0 < len(output) < 900 and client.responses.retrieve(queued.id).status == "cancelled"


def test_another_organizations_ids_are_not_found(live, client, mode, other_organization):
    response = client.responses.create(model=MODEL, input="mine", max_output_tokens=3)
    with openai.OpenAI(api_key=other_organization["api_key"], base_url=live.http_urls[mode], max_retries=0) as other:
        for call in (
            lambda: other.responses.retrieve(response.id),
            lambda: other.responses.input_items.list(response.id),
            lambda: other.responses.cancel(response.id),
            lambda: other.responses.delete(response.id),
            lambda: other.responses.create(model=MODEL, previous_response_id=response.id, input="theirs"),
        ):
            with pytest.raises(openai.NotFoundError):
                call()
    assert client.responses.retrieve(response.id).id == response.id
