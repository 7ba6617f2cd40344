"""The Responses API's mapping, without workers: the body read into a ResponsesRequest (every parameter
honoured or refused by name), input items into chat messages, the prompt's token ids (fresh: as the chat
template renders the conversation; continued: the stored conversation's own ids extended by exactly what the
template renders after them; truncated), and the Response object as the official openai client's types take
it, validated strictly."""

import pytest
from openai.types.responses import Response, ResponseItem
from pydantic import TypeAdapter

from gateway.core.pipeline import ESTIMATED_OUTPUT_TOKENS, reserved_output_tokens
from gateway.fleet.registry import ModelInfo, Registry
from gateway.openai_api.requests import HttpError
from gateway.openai_api.responses_items import chat_messages
from gateway.openai_api.responses_objects import ProducedOutput, ResponseRecord, response_json
from gateway.openai_api.responses_prompt import (
    TURN_MARKER,
    EarlierConversation,
    PromptRefused,
    response_prompt,
    template_messages,
)
from gateway.openai_api.responses_request import to_responses_request
from gateway.planning.tokenization import encode_chat, tokenizer_for
from gateway.planning.tools import template_tools
from gateway.planning.validation import plan_generation
from gateway.types import ChatMessage, FinishReason, GenerationOutput, GenerationRequest, ToolCall, Usage
from tests.gateway.harness import CONTEXT_LENGTH, ControlPlaneInMemory

MODEL = "diptych-tiny"
TOKENIZER = tokenizer_for(f"builtin:{MODEL}")
INFO = ModelInfo(name=MODEL, source=f"builtin:{MODEL}", context_length=1024)
EOS = TOKENIZER.eos_token_id
WEATHER = {
    "type": "function",
    "name": "get_weather",
    "description": "the weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
}


def asked(**body):
    return to_responses_request({"model": MODEL, "input": "hello", **body})


def refusal(**body) -> HttpError:
    with pytest.raises(HttpError) as refused:
        to_responses_request({"model": MODEL, "input": "hello", **body})
    return refused.value


# ---- the body ------------------------------------------------------------------------------------------


def test_a_string_input_is_one_user_message_and_the_defaults_are_openais():
    request = asked()
    (item,) = request.items
    assert item["type"] == "message" and item["role"] == "user" and item["id"].startswith("msg_")
    assert item["content"] == [{"type": "input_text", "text": "hello"}]
    assert (request.store, request.background, request.stream, request.truncation) == (True, False, False, "disabled")
    assert request.tools == () and request.response_format is None and request.metadata == {}


def test_items_of_every_kind_are_read_with_ids():
    request = asked(
        input=[
            {"role": "developer", "content": "be brief"},
            {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "weather?"}]},
            {"type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": '{"city":"Oslo"}'},
            {"type": "function_call_output", "call_id": "call_1", "output": "rain"},
            {"role": "assistant", "content": [{"type": "output_text", "text": "It rains."}]},
        ]
    )
    kinds = [(item["type"], item.get("role")) for item in request.items]
    assert kinds == [
        ("message", "developer"),
        ("message", "user"),
        ("function_call", None),
        ("function_call_output", None),
        ("message", "assistant"),
    ]
    assert request.items[4]["content"] == [{"type": "output_text", "text": "It rains.", "annotations": []}]
    assert len({item["id"] for item in request.items}) == 5
    items = TypeAdapter(list[ResponseItem]).validate_python(request.items)  # input_items' shapes
    assert [item.type for item in items] == [kind for kind, _ in kinds]


def test_function_calls_join_the_assistant_turn_they_follow():
    request = asked(
        input=[
            {"role": "user", "content": "weather in Oslo and Rome?"},
            {"role": "assistant", "content": "Let me look."},
            {"type": "function_call", "call_id": "c1", "name": "get_weather", "arguments": '{"city":"Oslo"}'},
            {"type": "function_call", "call_id": "c2", "name": "get_weather", "arguments": '{"city":"Rome"}'},
            {"type": "function_call_output", "call_id": "c1", "output": "rain"},
            {"type": "function_call_output", "call_id": "c2", "output": "sun"},
        ]
    )
    messages = chat_messages(request.items, "be brief")
    calls = (ToolCall("c1", "get_weather", '{"city":"Oslo"}'), ToolCall("c2", "get_weather", '{"city":"Rome"}'))
    assert messages == [
        ChatMessage("system", "be brief"),
        ChatMessage("user", "weather in Oslo and Rome?"),
        ChatMessage("assistant", "Let me look.", calls),
        ChatMessage("tool", "rain", tool_call_id="c1"),
        ChatMessage("tool", "sun", tool_call_id="c2"),
    ]


def test_function_tools_text_format_and_tool_choice_map_onto_the_chat_planning():
    request = asked(
        tools=[WEATHER],
        tool_choice={"type": "function", "name": "get_weather"},
        parallel_tool_calls=False,
        text={"format": {"type": "json_schema", "name": "answer", "schema": {"type": "object"}, "strict": True}},
    )
    (tool,) = request.tools
    assert (tool.name, tool.description) == ("get_weather", "the weather in a city")
    assert request.tool_choice.mode == "function" and request.tool_choice.function == "get_weather"
    assert request.parallel_tool_calls is False
    assert request.response_format.type == "json_schema" and request.response_format.name == "answer"
    assert request.response_format.strict is True and request.response_format.schema == '{"type": "object"}'
    assert request.tools_json[0]["name"] == "get_weather"
    assert asked(text={"format": {"type": "json_object"}}).response_format.type == "json_object"


@pytest.mark.parametrize(
    ("body", "param", "words"),
    [
        ({"reasoning": {"effort": "high"}}, "reasoning", "reasons"),
        ({"tools": [{"type": "web_search"}]}, "tools", "web_search tool"),
        ({"tools": [{"type": "file_search", "vector_store_ids": ["vs_1"]}]}, "tools", "built-in tools"),
        ({"tools": [{"type": "code_interpreter", "container": {"type": "auto"}}]}, "tools", "code_interpreter"),
        ({"tool_choice": {"type": "web_search_preview"}}, "tool_choice", "not offered"),
        ({"include": ["reasoning.encrypted_content"]}, "include", "reasoning.encrypted_content"),
        ({"include": ["message.output_text.logprobs"]}, "include", "cannot be honoured"),
        ({"prompt": {"id": "pmpt_1"}}, "prompt", "templates"),
        ({"conversation": "conv_1"}, "conversation", "previous_response_id"),
        ({"top_logprobs": 3}, "top_logprobs", "logprobs"),
        ({"max_tool_calls": 2}, "max_tool_calls", "built-in"),
        ({"background": True, "store": False}, "background", "stored"),
        ({"background": True, "stream": True}, "background", "poll"),
        ({"service_tier": "flex"}, "service_tier", "auto"),
        ({"truncation": "sometimes"}, "truncation", "auto"),
        ({"text": {"verbosity": "low"}}, "text", "verbosity"),
        ({"text": {"format": {"type": "json_schema", "name": "a"}}}, "text", "schema"),
        ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}, "input", "text only"),
        ({"input": [{"type": "item_reference", "id": "msg_1"}]}, "input", "item_reference"),
        ({"input": [{"type": "reasoning", "summary": []}]}, "input", "reasoning"),
        ({"input": []}, "input", "non-empty"),
        ({"input": [{"role": "tool", "content": "x"}]}, "input", "role"),
        ({"max_output_tokens": 0}, "max_output_tokens", "integer"),
        ({"max_output_tokens": "5"}, "max_output_tokens", "integer"),
        ({"temperature": "hot"}, "temperature", "number"),
        ({"store": "yes"}, "store", "true or false"),
        ({"metadata": {"k": 5}}, "metadata", "strings"),
        ({"metadata": {f"k{i}": "v" for i in range(17)}}, "metadata", "16"),
        ({"previous_response_id": "chatcmpl-1"}, "previous_response_id", "resp_"),
        ({"stream_options": {"include_obfuscation": True}}, "stream_options", "stream is true"),
        ({"surprise": 1}, "surprise", "not a parameter of /v1/responses"),
        ({"model": 5}, "model", "required"),
        ({"tools": [{"type": "function", "name": "f", "defer_loading": True}]}, "tools", "defer_loading"),
    ],
)
def test_what_is_not_done_here_is_refused_by_name(body, param, words):
    error = refusal(**body)
    assert error.param == param and words in error.message, error.message


def test_defaults_sent_explicitly_are_accepted():
    request = asked(
        reasoning=None,
        include=[],
        top_logprobs=0,
        service_tier="auto",
        truncation="disabled",
        text={"format": {"type": "text"}, "verbosity": "medium"},
        parallel_tool_calls=True,
        stream=True,
        stream_options={"include_obfuscation": False},
    )
    assert request.stream and request.response_format is None


# ---- the prompt ----------------------------------------------------------------------------------------


def prompt(items, earlier=None, instructions=None, tools=(), room=1, truncate=False, model=INFO):
    return response_prompt(TOKENIZER, model, instructions, tools, items, earlier, room, truncate)


def rendered(messages: list[ChatMessage], tools=()) -> list[int]:
    """What chat completions gives for the same conversation."""
    return encode_chat(TOKENIZER, template_messages(messages), template_tools(tools))


def test_a_fresh_prompt_is_what_chat_completions_renders():
    request = asked(instructions="be brief", input=[{"role": "user", "content": "hi"}], tools=[WEATHER])
    ids = prompt(request.items, instructions="be brief", tools=request.tools)
    expected = rendered([ChatMessage("system", "be brief"), ChatMessage("user", "hi")], request.tools)
    assert ids.token_ids == expected and not ids.continued


def earlier_of(items, output_text: str, output_ids: list[int], instructions=None, tools=()) -> EarlierConversation:
    prompt_ids = prompt(items, instructions=instructions, tools=tools).token_ids
    output_items = [{"id": "msg_o", "type": "message", "role": "assistant", "content": [{"text": output_text}]}]
    return EarlierConversation(MODEL, prompt_ids + output_ids, items, output_items, instructions, tools)


def test_a_continuation_extends_the_stored_ids_and_equals_the_whole_conversation_rendered():
    first = asked(input="tell me about caches").items
    answer = "Caches keep blocks."
    output_ids = TOKENIZER(answer, add_special_tokens=False)["input_ids"] + [EOS]  # ended by the model
    earlier = earlier_of(first, answer, output_ids)
    second = asked(input="and prefixes?").items
    continued = prompt(second, earlier)
    assert continued.continued and continued.token_ids[: len(earlier.token_ids)] == earlier.token_ids
    whole = [ChatMessage("user", "tell me about caches"), ChatMessage("assistant", answer)]
    assert continued.token_ids == rendered([*whole, ChatMessage("user", "and prefixes?")])


def test_a_continuation_after_an_output_cut_short_closes_the_turn_first():
    first = asked(input="count").items
    output_ids = TOKENIZER("one two", add_special_tokens=False)["input_ids"]  # max_output_tokens: no EOS
    earlier = earlier_of(first, "one two", output_ids)
    continued = prompt(asked(input="go on").items, earlier)
    tail = continued.token_ids[len(earlier.token_ids) :]
    assert tail[0] == EOS  # the template closes the assistant's turn before the next one
    whole = [ChatMessage("user", "count"), ChatMessage("assistant", "one two"), ChatMessage("user", "go on")]
    assert continued.token_ids == rendered(whole)


def test_the_rule_holds_for_output_that_does_not_retokenize_the_same():
    """The stored ids are kept as generated; the new turn's ids are the template's text after the assistant's turn."""
    first = asked(input="hi").items
    output_ids = [300, 301, 7, 300, EOS]  # whatever the model sampled
    earlier = earlier_of(first, TOKENIZER.decode(output_ids, skip_special_tokens=True), output_ids)
    new = asked(input="again").items
    continued = prompt(new, earlier)
    head = TOKENIZER.apply_chat_template(
        template_messages(chat_messages(first, None)), add_generation_prompt=True, tokenize=False
    )
    marked = template_messages(
        [*chat_messages(first, None), ChatMessage("assistant", TURN_MARKER), *chat_messages(new, None)]
    )
    whole = TOKENIZER.apply_chat_template(marked, add_generation_prompt=True, tokenize=False)
    tail_text = whole[len(head) + len(TURN_MARKER) :].removeprefix(TOKENIZER.eos_token)
    assert continued.token_ids == earlier.token_ids + TOKENIZER(tail_text, add_special_tokens=False)["input_ids"]


def test_a_function_call_output_continues_a_turn_of_calls():
    first = asked(input="weather in Oslo?", tools=[WEATHER])
    call_text = '<tool_call>[{"name": "get_weather", "arguments": {"city": "Oslo"}}]'
    output_ids = TOKENIZER(call_text, add_special_tokens=False)["input_ids"] + [EOS]
    earlier = earlier_of(first.items, "", output_ids, tools=first.tools)
    answer = asked(input=[{"type": "function_call_output", "call_id": "call_1", "output": "rain"}], tools=[WEATHER])
    continued = prompt(answer.items, earlier, tools=answer.tools)
    assert continued.continued
    call = ToolCall("call_1", "get_weather", '{"city": "Oslo"}')
    whole = [
        ChatMessage("user", "weather in Oslo?"),
        ChatMessage("assistant", "", (call,)),
        ChatMessage("tool", "rain", tool_call_id="call_1"),
    ]
    assert continued.token_ids == rendered(whole, first.tools)


def test_other_instructions_render_the_whole_conversation_afresh():
    first = asked(input="hi").items
    earlier = earlier_of(first, "yo", TOKENIZER("yo", add_special_tokens=False)["input_ids"] + [EOS])
    fresh = prompt(asked(input="again").items, earlier, instructions="be formal")
    assert not fresh.continued
    whole = [ChatMessage("system", "be formal"), ChatMessage("user", "hi"), ChatMessage("assistant", "yo")]
    assert fresh.token_ids == rendered([*whole, ChatMessage("user", "again")])


def test_too_long_is_context_length_exceeded_unless_truncation_drops_the_oldest_items():
    small = ModelInfo(name=MODEL, source=f"builtin:{MODEL}", context_length=64)
    items = asked(input=[{"role": "user", "content": f"message number {i} " * 3} for i in range(8)]).items
    with pytest.raises(PromptRefused) as refused:
        prompt(items, model=small, room=8)
    assert refused.value.code == "context_length_exceeded" and "truncation" in refused.value.message
    truncated = prompt(items, model=small, room=8, truncate=True)
    assert 0 < truncated.dropped_items < len(items) and len(truncated.token_ids) + 8 <= 64
    kept = chat_messages(items[truncated.dropped_items :], None)
    assert truncated.token_ids == rendered(kept)
    fewer = prompt(items[truncated.dropped_items - 1 :], model=small, room=8, truncate=True)
    assert fewer.dropped_items == 1  # one more item does not fit: the fewest were dropped


# ---- the Response object and its output ------------------------------------------------------------------


def record_with(produced: ProducedOutput, **request) -> ResponseRecord:
    record = ResponseRecord(
        id="resp_" + "a" * 32,
        organization_id="org_1",
        api_key_id="key_1",
        model=MODEL,
        request={**asked(**request).echoed},
        metadata={"k": "v"},
        context_items=[],
        input_items=asked().items,
        prompt_token_ids=[1, 2, 3],
    )
    record.ended(produced)
    return record


def produced_from(*outputs: GenerationOutput) -> ProducedOutput:
    produced = ProducedOutput()
    for output in outputs:
        produced.push(output)
    return produced


USAGE = Usage(prompt_tokens=3, completion_tokens=2, cached_tokens=0)


def test_a_text_answer_is_a_completed_response_the_openai_types_take():
    produced = produced_from(
        GenerationOutput("exec_1", "Hel", [5]), GenerationOutput("exec_1", "lo", [6], FinishReason.STOP, USAGE)
    )
    body = response_json(record_with(produced, temperature=0, max_output_tokens=9))
    response = Response.model_validate(body, strict=False)
    assert response.status == "completed" and response.output_text == "Hello"
    assert response.usage.input_tokens == 3 and response.usage.output_tokens == 2
    assert response.usage.input_tokens_details.cached_tokens == 0
    assert response.usage.output_tokens_details.reasoning_tokens == 0 and response.usage.total_tokens == 5
    assert response.max_output_tokens == 9 and response.temperature == 0 and response.metadata == {"k": "v"}
    assert produced.token_ids == [5, 6]


def test_an_answer_cut_by_max_output_tokens_is_incomplete():
    produced = produced_from(GenerationOutput("exec_1", "Hel", [5], FinishReason.LENGTH, USAGE))
    response = Response.model_validate(response_json(record_with(produced)))
    assert response.status == "incomplete" and response.incomplete_details.reason == "max_output_tokens"
    assert response.output[0].status == "incomplete"


def test_calls_are_function_call_items_after_any_text():
    calls = (ToolCall("call_a", "get_weather", '{"city": "Oslo"}'), ToolCall("call_b", "get_weather", "{}"))
    produced = produced_from(GenerationOutput("exec_1", "", [5], FinishReason.TOOL_CALLS, USAGE, tool_calls=calls))
    response = Response.model_validate(response_json(record_with(produced, tools=[WEATHER])))
    assert [item.type for item in response.output] == ["function_call", "function_call"]
    assert [(item.call_id, item.name, item.arguments) for item in response.output] == [
        ("call_a", "get_weather", '{"city": "Oslo"}'),
        ("call_b", "get_weather", "{}"),
    ]
    assert response.tools[0].name == "get_weather" and response.output[0].id.startswith("fc_")


async def test_the_planning_takes_the_rendered_ids_as_a_chat():
    """responses_api.py hands the rendered ids over with the conversation as `chat`: validation runs the ids
    (it reads prompt_token_ids first), and the request is a chat's to the rest of the planning (tools compile;
    without max_output_tokens it may use the rest of the context, and the rate limiter reserves a chat's
    estimate). If validation ever read chat first, or refused both, this fails."""
    registry = Registry(ControlPlaneInMemory())
    await registry.refresh()
    request = asked(tools=[WEATHER], input="weather?")
    rendered_prompt = prompt(request.items, tools=request.tools)
    generation = GenerationRequest(
        model=MODEL, prompt_token_ids=rendered_prompt.token_ids, chat=rendered_prompt.messages, tools=request.tools
    )
    plan = await plan_generation(generation, registry, "org_1")
    assert plan.prompt_token_ids == rendered_prompt.token_ids and plan.tools == request.tools
    assert plan.sampling.max_tokens == CONTEXT_LENGTH - len(rendered_prompt.token_ids)
    assert reserved_output_tokens(plan, generation) == ESTIMATED_OUTPUT_TOKENS
    assert rendered_prompt.messages == [ChatMessage("user", "weather?")]
