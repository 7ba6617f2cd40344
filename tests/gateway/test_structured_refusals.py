"""response_format, tools, tool_choice and parallel_tool_calls at the door: every bad one is a 400 (HTTP) or
INVALID_ARGUMENT (gRPC) naming the parameter, and nothing reaches a worker; good ones pass the door."""

import json

import grpc
import pytest

from diptych_proto.v1 import inference_pb2, inference_pb2_grpc
from tests.gateway.harness import API_KEY, MODEL, assert_openai_error_shape, in_process_gateway, post_json

MESSAGES = [{"role": "user", "content": "weather in Paris?"}]
CITY = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
TOOL = {"type": "function", "function": {"name": "get_weather", "parameters": CITY}}


@pytest.fixture
async def gateway(tmp_path):
    async with in_process_gateway(tmp_path) as gateway:
        yield gateway


def schema_format(schema) -> dict:
    return {"type": "json_schema", "json_schema": {"name": "answer", "schema": schema, "strict": True}}


BAD = [  # (extra body fields, param, part of the message)
    ({"response_format": schema_format({"type": "strnig"})}, "response_format", "Invalid type: strnig"),
    ({"response_format": schema_format({"$ref": "#/$defs/missing"})}, "response_format", "does not exist"),
    ({"response_format": schema_format({"type": "string", "format": "postcode"})}, "response_format", "format"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "a"}}}, "response_format", "is required"),
    ({"response_format": {"type": "json_schema", "json_schema": {"schema": []}}}, "response_format", "must be an"),
    ({"response_format": schema_format(CITY) | {"type": "yaml"}}, "response_format", "use one of text"),
    ({"response_format": "json"}, "response_format", "must be an object"),
    ({"tool_choice": "required"}, "tool_choice", "tools is empty"),
    ({"tool_choice": "none"}, "tool_choice", "tools is empty"),
    ({"parallel_tool_calls": False}, "parallel_tool_calls", "tools is empty"),
    (
        {"tools": [TOOL], "tool_choice": {"type": "function", "function": {"name": "get_time"}}},
        "tool_choice",
        "'get_time', which is not in tools; name one of get_weather",
    ),
    ({"tools": [TOOL], "tool_choice": "always"}, "tool_choice", "must be"),
    ({"tools": [TOOL, TOOL]}, "tools", "given twice"),
    ({"tools": [{"type": "function", "function": {"name": "get weather"}}]}, "tools", "letters, digits"),
    ({"tools": [{"type": "retrieval"}]}, "tools", '"type": "function"'),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "strnig"}}}]}, "tools", "strnig"),
    (
        {"tools": [{"type": "function", "function": {"name": "f", "parameters": {"$ref": "#/$defs/a"}}}]},
        "tools",
        "does not exist",
    ),
    ({"tools": [TOOL], "parallel_tool_calls": "yes"}, "parallel_tool_calls", "true or false"),
]


@pytest.mark.parametrize(("fields", "param", "message"), BAD)
async def test_bad_structured_outputs_and_tools_are_a_400_naming_the_parameter(gateway, fields, param, message):
    body = json.dumps({"model": MODEL, "messages": MESSAGES, **fields}).encode()
    status, payload = await post_json(gateway, "/v1/chat/completions", body)
    assert status == 400, payload
    assert_openai_error_shape(payload)
    assert message in payload["error"]["message"] and payload["error"]["param"] == param
    assert gateway.path.runs == 0


CALL = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
BAD_MESSAGES = [  # (messages, part of the message)
    ([*MESSAGES, {"role": "tool", "content": "sunny"}], "without tool_call_id"),
    ([*MESSAGES, {"role": "assistant", "content": None, "tool_calls": [CALL | {"function": {"name": "f"}}]}], "call"),
    (
        [*MESSAGES, {"role": "assistant", "tool_calls": [CALL | {"function": {"name": "f", "arguments": "{"}}]}],
        "arguments that are not JSON",
    ),
    ([{"role": "user", "content": "x", "tool_calls": [CALL]}], "only an assistant message"),
]


@pytest.mark.parametrize(("messages", "message"), BAD_MESSAGES)
async def test_bad_tool_messages_are_a_400(gateway, messages, message):
    body = json.dumps({"model": MODEL, "messages": messages, "tools": [TOOL]}).encode()
    status, payload = await post_json(gateway, "/v1/chat/completions", body)
    assert status == 400 and message in payload["error"]["message"], payload
    assert gateway.path.runs == 0


GOOD = [
    {"response_format": {"type": "text"}},
    {"response_format": {"type": "json_object"}},
    {"response_format": schema_format(CITY)},
    {"tools": [TOOL]},
    {"tools": [TOOL], "tool_choice": "required", "parallel_tool_calls": False},
    {"tools": [TOOL], "tool_choice": {"type": "function", "function": {"name": "get_weather"}}},
    {"tools": [TOOL], "tool_choice": "none", "response_format": schema_format(CITY)},
    {
        "tools": [TOOL],
        "messages": [
            *MESSAGES,
            {"role": "assistant", "content": None, "tool_calls": [CALL]},
            {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
        ],
    },
]


@pytest.mark.parametrize("fields", GOOD)
async def test_good_ones_pass_the_door(gateway, fields):
    body = json.dumps({"model": MODEL, "messages": MESSAGES, **fields}).encode()
    status, payload = await post_json(gateway, "/v1/chat/completions", body)
    assert status == 503, payload  # past the door: the harness has no workers
    assert gateway.path.runs == 1


async def _grpc_error(gateway, **fields) -> grpc.aio.AioRpcError:
    stub = inference_pb2_grpc.InferenceStub(gateway.channel)
    chat = inference_pb2.ChatMessages(messages=[inference_pb2.ChatMessage(role="user", content="hi")])
    call = stub.Generate(
        inference_pb2.GenerateRequest(model=MODEL, chat=chat, **fields),
        metadata=(("authorization", f"Bearer {API_KEY}"),),
    )
    with pytest.raises(grpc.aio.AioRpcError) as raised:
        async for _ in call:
            pass
    return raised.value


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"response_format": inference_pb2.ResponseFormat(type="json_schema", json_schema="[")}, "not valid JSON"),
        ({"response_format": inference_pb2.ResponseFormat(type="json_schema")}, "is required"),
        ({"tool_choice": inference_pb2.ToolChoice(mode="required")}, "tools is empty"),
        (
            {"tools": [inference_pb2.Tool(name="f")], "tool_choice": inference_pb2.ToolChoice(function_name="g")},
            "'g', which is not in tools",
        ),
        ({"tools": [inference_pb2.Tool(name="f", parameters='{"type": 3}')]}, "tools[0].function.parameters"),
    ],
)
async def test_grpc_refuses_them_as_invalid_argument(gateway, fields, message):
    error = await _grpc_error(gateway, **fields)
    assert error.code() is grpc.StatusCode.INVALID_ARGUMENT and message in error.details(), error.details()
    assert gateway.path.runs == 0


async def test_tools_need_a_chat(gateway):
    stub = inference_pb2_grpc.InferenceStub(gateway.channel)
    request = inference_pb2.GenerateRequest(model=MODEL, prompt="hi", tools=[inference_pb2.Tool(name="f")])
    with pytest.raises(grpc.aio.AioRpcError) as raised:
        async for _ in stub.Generate(request, metadata=(("authorization", f"Bearer {API_KEY}"),)):
            pass
    assert raised.value.code() is grpc.StatusCode.INVALID_ARGUMENT and "tools need a chat" in raised.value.details()
