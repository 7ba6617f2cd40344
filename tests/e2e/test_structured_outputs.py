"""Structured outputs and tools on the live platform, driven by the official `openai` client, in split and
colocated mode. The model has random weights: only the grammar makes its output valid JSON, so these
tests fail whenever response_format or tool_choice is not honoured."""

import json

import jsonschema
import openai
import pytest

import diptych

MODEL = "diptych-tiny"
PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "pets": {"type": "array", "items": {"enum": ["cat", "dog"]}, "maxItems": 2},
    },
    "required": ["name", "age"],
    "additionalProperties": False,
}
WEATHER = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 12}, "unit": {"enum": ["C", "F"]}},
    "required": ["city", "unit"],
    "additionalProperties": False,
}
TIME = {
    "type": "object",
    "properties": {"zone": {"enum": ["UTC", "CET"]}},
    "required": ["zone"],
    "additionalProperties": False,
}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "today's weather", "parameters": WEATHER}},
    {"type": "function", "function": {"name": "get_time", "parameters": TIME}},
]
PARAMETERS = {"get_weather": WEATHER, "get_time": TIME}
QUESTIONS = ["Describe someone.", "Who lives next door?", "Tell me about the prefill worker and its cache."]


@pytest.fixture(params=["split", "colocated"])
def client(live, request):
    with openai.OpenAI(api_key=live.api_key, base_url=live.http_urls[request.param], max_retries=0) as client:
        yield client


def ask(question: str) -> list[dict]:
    return [{"role": "user", "content": question}]


def person_format() -> dict:
    return {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}}


@pytest.mark.parametrize("question", QUESTIONS)
def test_a_json_schema_answer_parses_and_follows_the_schema(client, question):
    chat = client.chat.completions.create(
        model=MODEL, messages=ask(question), max_tokens=150, temperature=0, response_format=person_format()
    )
    choice = chat.choices[0]
    assert choice.finish_reason == "stop"
    jsonschema.validate(json.loads(choice.message.content), PERSON)


def test_sampled_answers_follow_the_schema_too(client):
    for seed in range(3):
        chat = client.chat.completions.create(
            model=MODEL, messages=ask(QUESTIONS[0]), max_tokens=150, temperature=1.0, seed=seed,
            response_format=person_format(),
        )  # fmt: skip
        jsonschema.validate(json.loads(chat.choices[0].message.content), PERSON)


def test_a_json_object_answer_is_one_object(client):
    chat = client.chat.completions.create(
        model=MODEL, messages=ask(QUESTIONS[1]), max_tokens=400, temperature=0, response_format={"type": "json_object"}
    )
    assert chat.choices[0].finish_reason == "stop"
    assert isinstance(json.loads(chat.choices[0].message.content), dict)


def test_a_streamed_json_answer_is_the_whole_answer(client):
    whole = client.chat.completions.create(
        model=MODEL, messages=ask(QUESTIONS[2]), max_tokens=150, temperature=0, response_format=person_format()
    )
    chunks = list(
        client.chat.completions.create(
            model=MODEL, messages=ask(QUESTIONS[2]), max_tokens=150, temperature=0, response_format=person_format(),
            stream=True,
        )
    )  # fmt: skip
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    jsonschema.validate(json.loads(text), PERSON)


def assert_valid_calls(message, names: set[str]) -> None:
    assert message.content is None and message.tool_calls
    for call in message.tool_calls:
        assert call.type == "function" and call.id.startswith("call_") and call.function.name in names
        jsonschema.validate(json.loads(call.function.arguments), PARAMETERS[call.function.name])


@pytest.mark.parametrize("question", QUESTIONS)
def test_tool_choice_required_gives_a_valid_tool_call(client, question):
    chat = client.chat.completions.create(
        model=MODEL, messages=ask(question), max_tokens=150, temperature=0, tools=TOOLS, tool_choice="required",
        parallel_tool_calls=False,
    )  # fmt: skip
    choice = chat.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert_valid_calls(choice.message, set(PARAMETERS))
    assert len(choice.message.tool_calls) == 1


def test_a_named_tool_choice_calls_that_tool(client):
    for question in QUESTIONS:
        chat = client.chat.completions.create(
            model=MODEL, messages=ask(question), max_tokens=150, temperature=0, tools=TOOLS,
            tool_choice={"type": "function", "function": {"name": "get_time"}}, parallel_tool_calls=False,
        )  # fmt: skip
        assert chat.choices[0].finish_reason == "stop"  # as OpenAI answers a named function
        assert_valid_calls(chat.choices[0].message, {"get_time"})


def test_tool_choice_auto_answers_or_calls_validly(client):
    for question in QUESTIONS:
        chat = client.chat.completions.create(
            model=MODEL, messages=ask(question), max_tokens=40, temperature=0, tools=TOOLS, parallel_tool_calls=False
        )
        choice = chat.choices[0]
        if choice.finish_reason == "tool_calls":
            assert_valid_calls(choice.message, set(PARAMETERS))
        else:
            assert choice.message.tool_calls is None and not choice.message.content.startswith("<tool_call>")


def test_streamed_tool_calls_arrive_as_indexed_deltas(client):
    request = dict(
        model=MODEL, messages=ask(QUESTIONS[0]), max_tokens=150, temperature=0, tools=TOOLS, tool_choice="required",
        parallel_tool_calls=False,
    )  # fmt: skip
    whole = client.chat.completions.create(**request)
    chunks = list(client.chat.completions.create(**request, stream=True))
    deltas = [call for c in chunks if c.choices for call in c.choices[0].delta.tool_calls or ()]
    assert [d.index for d in deltas] == [0]
    assert not "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    expected = whole.choices[0].message.tool_calls[0].function
    assert (deltas[0].function.name, deltas[0].function.arguments) == (expected.name, expected.arguments)
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == ["tool_calls"]


def test_a_conversation_with_earlier_calls_and_their_results_goes_on(client):
    first = client.chat.completions.create(
        model=MODEL, messages=ask("weather?"), max_tokens=150, temperature=0, tools=TOOLS, tool_choice="required",
        parallel_tool_calls=False,
    )  # fmt: skip
    call = first.choices[0].message.tool_calls[0]
    messages = [
        *ask("weather?"),
        {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
        {"role": "tool", "tool_call_id": call.id, "content": "sunny, 21 C"},
    ]
    second = client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=150, temperature=0, tools=TOOLS, tool_choice="none",
        response_format=person_format(),
    )  # fmt: skip
    assert second.choices[0].message.tool_calls is None
    jsonschema.validate(json.loads(second.choices[0].message.content), PERSON)
    assert second.usage.prompt_tokens > first.usage.prompt_tokens  # the call and its result were rendered


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": 1}}}}, None),
        ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
        ({"tool_choice": "required"}, "tool_choice"),
    ],
)
def test_bad_requests_are_a_400_for_the_client(client, fields, param):
    with pytest.raises(openai.BadRequestError) as raised:
        client.chat.completions.create(model=MODEL, messages=ask("hi"), max_tokens=5, **fields)
    assert raised.value.status_code == 400
    assert raised.value.body["param"] == (param or "response_format")


@pytest.mark.parametrize("mode", ["split", "colocated"])
def test_the_sdk_over_grpc_gets_json_and_typed_tool_calls(live, mode):
    with diptych.Client(api_key=live.api_key, base_url=live.gateways[mode]) as sdk:
        answer = sdk.chat.completions.create(
            model=MODEL, messages=ask(QUESTIONS[0]), max_tokens=150, temperature=0, response_format=person_format()
        )
        assert answer.finish_reason == "stop"
        jsonschema.validate(json.loads(answer.text), PERSON)
        called = sdk.chat.completions.create(
            model=MODEL, messages=ask(QUESTIONS[0]), max_tokens=150, temperature=0, tools=TOOLS,
            tool_choice={"type": "function", "function": {"name": "get_weather"}}, parallel_tool_calls=False,
        )  # fmt: skip
        assert called.finish_reason == "stop" and called.text == ""
        (call,) = called.tool_calls
        assert call.type == "function" and call.function.name == "get_weather"
        jsonschema.validate(json.loads(call.function.arguments), WEATHER)
        with pytest.raises(diptych.BadRequestError, match="not in tools"):
            sdk.chat.completions.create(
                model=MODEL,
                messages=ask("hi"),
                tools=TOOLS,
                tool_choice={"type": "function", "function": {"name": "x"}},
            )
