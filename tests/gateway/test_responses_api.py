"""The Responses API through the whole gateway, driven by the official openai client, over a colocated worker
of the built-in tiny model served in this process: greedy output equal to `transformers` generate, streamed
events the client accumulates, stored responses retrieved, listed and deleted, a continuation
(previous_response_id) running on the stored conversation's own token ids and billed its prefix-cache hit as
cached, function calls answered and continued, json_schema output, background responses cancelled, another
organization's ids never reached, rate limits and idempotency keys as on chat completions, and bad input
refused in OpenAI's error shape before anything runs or is stored."""

import asyncio
import json

import jsonschema
import openai
import pytest

from diptych_common.builtin import DIPTYCH_TINY
from diptych_common.grammar import llguidance_tokenizer
from gateway.planning.tokenization import encode_chat, tokenizer_for
from gateway.routing.route import ServingMode
from tests.gateway.harness import API_KEY, MODEL, assert_openai_error_shape
from tests.gateway.responses_harness import OTHER_API_KEY, headers, responses_gateway
from tests.workers.conftest import executor, reference, tiny_model, wait_until  # noqa: F401 - the workers' fixtures
from workers.serving.server import Role
from workers.structured.compiler import GrammarCompiler

TOKENIZER = tokenizer_for(f"builtin:{MODEL}")
EOS = TOKENIZER.eos_token_id
BLOCK = 16  # the workers' KV block size
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
ANSWER = {
    "type": "object",
    "properties": {"answer": {"enum": ["yes", "no"]}},
    "required": ["answer"],
    "additionalProperties": False,
}
LONG_QUESTION = "Tell me how a prefix cache keeps the blocks of a conversation between its turns. " * 3


@pytest.fixture(scope="module")
def grammars():
    return GrammarCompiler(llguidance_tokenizer(TOKENIZER, DIPTYCH_TINY.llama_config["vocab_size"], frozenset({EOS})))


@pytest.fixture
async def gateway(tmp_path, tiny_model, executor, grammars):  # noqa: F811
    async with responses_gateway(tmp_path, tiny_model, executor, COLOCATED, ServingMode.COLOCATED, grammars) as gw:
        yield gw


@pytest.fixture
async def client(gateway):
    async with openai.AsyncOpenAI(api_key=API_KEY, base_url=gateway.base_url, max_retries=0) as client:
        yield client


def stored_ids(gateway, response_id: str) -> tuple[list[int], list[int]]:
    stored = gateway.control_plane.responses[response_id]
    return stored["prompt_token_ids"], stored["output_token_ids"]


def assert_greedy(output: list[int], expected: list[int], budget: int) -> None:
    """Our output is generate's, up to the end-of-sequence token where the model chose it."""
    assert output == expected[: len(output)]
    assert len(output) == budget or output[-1] == EOS


async def test_a_response_is_transformers_greedy_output_and_the_client_parses_it(gateway, client, reference):  # noqa: F811
    response = await client.responses.create(
        model=MODEL, input="tell me about caches", max_output_tokens=12, temperature=0
    )
    assert response.id.startswith("resp_") and response.object == "response" and response.model == MODEL
    prompt, output = stored_ids(gateway, response.id)
    assert prompt == encode_chat(TOKENIZER, [{"role": "user", "content": "tell me about caches"}])
    assert_greedy(output, reference(prompt, 12), 12)
    assert response.output_text == TOKENIZER.decode(output, skip_special_tokens=True)
    assert response.status == ("incomplete" if output[-1] != EOS else "completed")
    usage = response.usage
    assert (usage.input_tokens, usage.output_tokens, usage.total_tokens) == (
        len(prompt),
        len(output),
        len(prompt) + len(output),
    )
    assert usage.output_tokens_details.reasoning_tokens == 0
    assert (await client.responses.retrieve(response.id)).model_dump() == response.model_dump()


async def test_a_streamed_response_is_the_whole_one_event_by_event(gateway, client):
    # A schema's answer ends of itself (completed): the client's get_final_response wants response.completed.
    text = {"format": {"type": "json_schema", "name": "answer", "schema": ANSWER, "strict": True}}
    asked = {"model": MODEL, "input": "stream it", "max_output_tokens": 40, "temperature": 0, "text": text}
    whole = await client.responses.create(**asked)
    async with client.responses.stream(**asked) as stream:
        kinds = [event.type async for event in stream]
        final = await stream.get_final_response()
    assert kinds[:4] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
    ]
    assert kinds[-1] == "response.completed" and whole.status == "completed"
    assert final.output_text == whole.output_text and final.usage.output_tokens == whole.usage.output_tokens
    assert (await client.responses.retrieve(final.id)).output_text == whole.output_text
    cut = {"model": MODEL, "input": "stream it", "max_output_tokens": 3, "temperature": 0}
    events = [event async for event in await client.responses.create(**cut, stream=True)]
    assert [event.sequence_number for event in events] == list(range(len(events)))
    assert events[-1].type == "response.incomplete" and events[-1].response.usage.output_tokens == 3
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert deltas == events[-1].response.output_text == (await client.responses.create(**cut)).output_text


async def test_a_continuation_runs_on_the_stored_ids_and_its_prefix_hit_is_cached(gateway, client, reference):  # noqa: F811
    first = await client.responses.create(model=MODEL, input=LONG_QUESTION, max_output_tokens=24, temperature=0)
    second = await client.responses.create(
        model=MODEL, previous_response_id=first.id, input="and between gateways?", max_output_tokens=6, temperature=0
    )
    first_prompt, first_output = stored_ids(gateway, first.id)
    second_prompt, second_output = stored_ids(gateway, second.id)
    conversation = first_prompt + first_output
    assert second_prompt[: len(conversation)] == conversation
    # The worker computed every token of the conversation but the last output token (never fed back): its
    # whole blocks are hits; the rest is computed.
    assert second.usage.input_tokens_details.cached_tokens == (len(conversation) - 1) // BLOCK * BLOCK > 0
    assert second.usage.input_tokens == len(second_prompt)
    assert_greedy(second_output, reference(second_prompt, 6), 6)
    assert second.previous_response_id == first.id
    context = gateway.control_plane.responses[second.id]["context_items"]
    assert [item["type"] for item in context] == ["message", "message"]  # the first's input and output


async def test_function_calls_are_answered_and_the_conversation_goes_on(gateway, client):
    called = await client.responses.create(
        model=MODEL, input="the weather?", tools=[WEATHER], tool_choice="required", max_output_tokens=60, temperature=0
    )
    (call,) = called.output
    assert call.type == "function_call" and call.name == "get_weather" and call.call_id.startswith("call_")
    assert json.loads(call.arguments)["unit"] in ("C", "F")
    answered = await client.responses.create(
        model=MODEL,
        previous_response_id=called.id,
        tools=[WEATHER],
        input=[{"type": "function_call_output", "call_id": call.call_id, "output": "rain, 12 degrees"}],
        tool_choice="none",
        max_output_tokens=8,
        temperature=0,
    )
    assert answered.output[0].type == "message"
    called_prompt, called_output = stored_ids(gateway, called.id)
    answered_prompt, _ = stored_ids(gateway, answered.id)
    assert answered_prompt[: len(called_prompt) + len(called_output)] == called_prompt + called_output
    assert answered.usage.input_tokens_details.cached_tokens > 0


async def test_a_json_schema_answer_follows_the_schema(client):
    text = {"format": {"type": "json_schema", "name": "answer", "schema": ANSWER, "strict": True}}
    response = await client.responses.create(
        model=MODEL, input="yes or no?", text=text, max_output_tokens=40, temperature=0
    )
    jsonschema.validate(json.loads(response.output_text), ANSWER)
    assert response.text.format.type == "json_schema"


async def test_store_false_keeps_nothing(gateway, client):
    response = await client.responses.create(model=MODEL, input="forget me", store=False, max_output_tokens=4)
    assert response.store is False and response.id not in gateway.control_plane.responses
    with pytest.raises(openai.NotFoundError):
        await client.responses.retrieve(response.id)
    with pytest.raises(openai.NotFoundError) as missing:
        await client.responses.create(model=MODEL, previous_response_id=response.id, input="again")
    assert missing.value.body["param"] == "previous_response_id"


async def test_input_items_are_listed_and_a_deleted_response_is_gone(gateway, client):
    response = await client.responses.create(
        model=MODEL,
        input=[{"role": "user", "content": "one"}, {"role": "user", "content": "two"}],
        max_output_tokens=3,
    )
    items = await client.responses.input_items.list(response.id)
    stored = gateway.control_plane.responses[response.id]["input_items"]
    assert [item.id for item in items.data] == [item["id"] for item in reversed(stored)]
    await client.responses.delete(response.id)
    with pytest.raises(openai.NotFoundError):
        await client.responses.retrieve(response.id)
    with pytest.raises(openai.NotFoundError):
        await client.responses.delete(response.id)


async def test_a_background_response_is_cancelled_and_billed_for_what_it_produced(gateway, client):
    queued = await client.responses.create(
        model=MODEL, input="go on and on", background=True, max_output_tokens=900, temperature=1, extra_body={"seed": 3}
    )
    assert queued.status == "queued" and queued.background is True
    while (await client.responses.retrieve(queued.id)).status == "queued":
        await asyncio.sleep(0.01)
    cancelled = await client.responses.cancel(queued.id)
    assert cancelled.status == "cancelled"
    _, output = stored_ids(gateway, queued.id)
    assert 0 < len(output) < 900
    assert (await client.responses.retrieve(queued.id)).status == "cancelled"
    billed = {event["phase"]: event["tokens"] for _, event in gateway.journal.oldest(100)}
    prompt, _ = stored_ids(gateway, queued.id)
    assert billed == {"prefill": len(prompt), "decode": len(output)}  # once each, what was produced
    assert (await client.responses.cancel(queued.id)).status == "cancelled"  # again: as it was
    with pytest.raises(openai.BadRequestError):
        await client.responses.create(model=MODEL, input="x", background=True, store=False)


async def test_a_background_response_deleted_elsewhere_is_not_stored_again_by_its_run(gateway, client):
    """Deleted through another gateway (here: straight from the control plane) before its first token: its run
    stores nothing back (the progress and the final store only update), and stops once it sees it gone."""
    queued = await client.responses.create(
        model=MODEL, input="go on", background=True, max_output_tokens=900, temperature=1, extra_body={"seed": 6}
    )
    gateway.control_plane.responses.pop(queued.id)

    def run_ended() -> bool:
        return any(
            s["id"] == queued.id and s["status"] not in ("queued", "in_progress") for s in gateway.control_plane.stores
        )

    assert await wait_until(run_ended, timeout=20)
    assert queued.id not in gateway.control_plane.responses
    final = [s for s in gateway.control_plane.stores if s["id"] == queued.id][-1]
    assert final["status"] == "cancelled" and len(final["output_token_ids"]) < 900  # it stopped early


async def test_a_completed_or_foreground_response_cannot_be_cancelled(gateway, client):
    done = await client.responses.create(model=MODEL, input="quick", max_output_tokens=2)
    with pytest.raises(openai.BadRequestError) as refused:
        await client.responses.cancel(done.id)
    assert "background" in refused.value.body["message"]
    assert (await client.responses.retrieve(done.id)).status in ("completed", "incomplete")


async def test_another_organizations_ids_are_not_found(gateway, client):
    response = await client.responses.create(model=MODEL, input="mine", max_output_tokens=3)
    before = json.dumps(gateway.control_plane.responses, sort_keys=True)
    async with openai.AsyncOpenAI(api_key=OTHER_API_KEY, base_url=gateway.base_url, max_retries=0) as other:
        for call in (
            other.responses.retrieve(response.id),
            other.responses.delete(response.id),
            other.responses.cancel(response.id),
            other.responses.input_items.list(response.id),
            other.responses.create(model=MODEL, previous_response_id=response.id, input="theirs"),
        ):
            with pytest.raises(openai.NotFoundError):
                await call
    assert json.dumps(gateway.control_plane.responses, sort_keys=True) == before


async def test_an_idempotency_key_replays_the_same_response(gateway, client):
    asked = {"model": MODEL, "input": "once", "max_output_tokens": 4, "temperature": 0}
    key = {"Idempotency-Key": "responses-once-1"}
    first = await client.responses.with_raw_response.create(**asked, extra_headers=key)
    again = await client.responses.with_raw_response.create(**asked, extra_headers=key)
    assert again.headers["idempotent-replayed"] == "true"
    assert again.parse().model_dump() == first.parse().model_dump()
    assert gateway.path.runs == 1


async def test_too_long_is_context_length_exceeded_unless_truncation_is_auto(gateway, client):
    words = [{"role": "user", "content": "many words in this message " * 20} for _ in range(12)]
    with pytest.raises(openai.BadRequestError) as refused:
        await client.responses.create(model=MODEL, input=words, max_output_tokens=4)
    assert refused.value.body["code"] == "context_length_exceeded" and refused.value.body["param"] == "input"
    assert gateway.path.runs == 0
    fitted = await client.responses.create(model=MODEL, input=words, truncation="auto", max_output_tokens=4)
    prompt, _ = stored_ids(gateway, fitted.id)
    assert len(prompt) + 4 <= 1024 and fitted.truncation == "auto"


HUGE = 9 << 20


@pytest.mark.parametrize(
    ("body", "status"),
    [
        (b"{not json", 400),
        (b"[1, 2]", 400),
        (json.dumps({"model": MODEL, "input": "x", "bogus": 1}).encode(), 400),
        (json.dumps({"model": MODEL, "input": 5}).encode(), 400),
        (json.dumps({"model": MODEL, "input": [{"role": "user", "content": [[[]]]}]}).encode(), 400),
        (b'{"model": "diptych-tiny", "input": "\\ud800"}', 400),
        (b'{"model": "diptych-tiny", "input": "\xff\xfe"}', 400),
        (b'{"model": "diptych-tiny", "input": ' + b"[" * 100 + b"]" * 100 + b"}", 400),
        (json.dumps({"model": MODEL, "input": [{"role": "user", "content": "x"}] * 3000}).encode(), 400),
        (json.dumps({"model": MODEL, "input": "x" * (6 << 20)}).encode(), 400),
        (b'{"model": "diptych-tiny", "input": "' + b"x" * HUGE + b'"}', 413),
        (json.dumps({"model": "nope", "input": "x"}).encode(), 404),
        (json.dumps({"model": MODEL, "input": "x", "temperature": 9}).encode(), 400),
        (json.dumps({"model": MODEL, "input": "x", "max_output_tokens": 5000}).encode(), 400),
        (
            json.dumps(
                {
                    "model": MODEL,
                    "input": "x",
                    "tools": [{"type": "function", "name": "f", "parameters": {"$ref": "#"}}],
                }
            ).encode(),
            400,
        ),
    ],
)
async def test_bad_input_is_refused_in_openais_shape_changing_nothing(gateway, body, status):
    response = await gateway.http.post(
        "/v1/responses", data=body, headers={**headers(), "Content-Type": "application/json"}
    )
    assert response.status == status, await response.text()
    assert_openai_error_shape(await response.json())
    assert gateway.path.runs == 0 and not gateway.control_plane.stores and gateway.journal.count() == 0


@pytest.mark.parametrize(
    ("method", "path"),
    [
        ("GET", "/v1/responses/not-an-id"),
        ("GET", "/v1/responses/resp_abc?stream=true"),
        ("GET", "/v1/responses/resp_abc?surprise=1"),
        ("DELETE", "/v1/responses/resp_%2E%2E"),
        ("POST", "/v1/responses/resp_abc/cancel"),
        ("GET", "/v1/responses/resp_abc/input_items?order=sideways&bogus=1"),
    ],
)
async def test_bad_ids_and_queries_are_4xx_in_openais_shape(gateway, method, path):
    response = await gateway.http.request(method, path, headers=headers())
    assert 400 <= response.status < 500, await response.text()
    assert_openai_error_shape(await response.json())


async def test_without_a_valid_key_nothing_is_answered(gateway):
    for method, path in (("POST", "/v1/responses"), ("GET", "/v1/responses/resp_abc")):
        for authorization in ("Bearer wrong", "Bearer caf\u00e9"):
            answer = await gateway.http.request(method, path, headers={"Authorization": authorization}, json={})
            assert answer.status == 401, await answer.text()
            assert_openai_error_shape(await answer.json())


async def test_rate_limits_apply_and_are_told_in_headers(tmp_path, tiny_model, executor, grammars):  # noqa: F811
    async with responses_gateway(tmp_path, tiny_model, executor, COLOCATED, ServingMode.COLOCATED, grammars) as gw:
        gw.control_plane.identity["limits"] = {"api_key": {"requests_per_minute": 2}}
        body = {"model": MODEL, "input": "hi", "max_output_tokens": 2}
        answers = [await gw.http.post("/v1/responses", json=body, headers=headers()) for _ in range(3)]
        assert [a.status for a in answers] == [200, 200, 429]
        assert answers[0].headers["x-ratelimit-limit-requests"] == "2"
        assert (await answers[2].json())["error"]["code"] == "rate_limit_exceeded"
        stored = (await answers[0].json())["id"]
        fetched = await gw.http.get(f"/v1/responses/{stored}", headers=headers())
        assert fetched.status == 200 and "x-ratelimit-limit-requests" in fetched.headers
        assert gw.path.runs == 2
