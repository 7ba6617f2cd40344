"""The SDK's structured outputs and tools: its parameters as the contract carries them, and tool calls
read back as typed objects."""

import json

import diptych
from diptych._convert import chat_input, chunk_from_proto, completion_from_chunks, structured_input
from diptych_proto.v1 import inference_pb2 as pb

SCHEMA = {"type": "object", "properties": {"city": {"type": "string"}}}
TOOL = {"type": "function", "function": {"name": "get_weather", "description": "d", "parameters": SCHEMA}}


def test_response_format_and_tools_as_the_contract_carries_them():
    fields = structured_input(
        {"type": "json_schema", "json_schema": {"name": "w", "schema": SCHEMA, "strict": True}},
        [TOOL],
        {"type": "function", "function": {"name": "get_weather"}},
        False,
    )
    request = pb.GenerateRequest(**fields)
    assert request.response_format == pb.ResponseFormat(
        type="json_schema", json_schema=json.dumps(SCHEMA), name="w", strict=True
    )
    assert list(request.tools) == [pb.Tool(name="get_weather", description="d", parameters=json.dumps(SCHEMA))]
    assert request.tool_choice.mode == "function" and request.tool_choice.function_name == "get_weather"
    assert request.tool_choice.HasField("parallel_tool_calls") and not request.tool_choice.parallel_tool_calls


def test_unset_ones_stay_unset():
    request = pb.GenerateRequest(**structured_input(None, None, None, None))
    assert not request.HasField("response_format") and not request.HasField("tool_choice") and not request.tools
    assert pb.GenerateRequest(**structured_input({"type": "json_object"}, None, "required", None)).tool_choice == (
        pb.ToolChoice(mode="required")
    )


def test_a_conversation_with_calls_and_their_results():
    call = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}
    messages = [
        {"role": "user", "content": "weather?"},
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "call_1", "content": "rain"},
    ]
    chat = chat_input(messages)["chat"].messages
    assert chat[1] == pb.ChatMessage(
        role="assistant", tool_calls=[pb.ToolCall(id="call_1", name="get_weather", arguments='{"city": "Oslo"}')]
    )
    assert chat[2] == pb.ChatMessage(role="tool", content="rain", tool_call_id="call_1")


def test_tool_calls_come_back_typed():
    last = pb.GenerateResponse(
        request_id="exec_1",
        token_ids=[5],
        finish_reason=pb.FINISH_REASON_TOOL_CALLS,
        usage=pb.Usage(prompt_tokens=3, completion_tokens=1),
        tool_calls=[pb.ToolCall(id="call_1", name="get_weather", arguments="{}")],
    )
    chunk = chunk_from_proto(last)
    expected = [diptych.types.ToolCall("call_1", diptych.types.FunctionCall("get_weather", "{}"))]
    assert chunk.finish_reason == "tool_calls" and chunk.tool_calls == expected
    completion = completion_from_chunks([chunk], model="m")
    assert completion.tool_calls == expected and completion.choices[0].tool_calls == expected
    assert chunk_from_proto(pb.GenerateResponse(request_id="exec_1", text="a")).tool_calls is None
