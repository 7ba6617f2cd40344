"""The OpenAI shapes of structured outputs and tools: response_format, tools, tool_choice,
parallel_tool_calls and the tool fields of chat messages read into the gateway's types (checked for shape
here, for meaning in `structured.py`), and tool calls written back as a message's or a stream's."""

import json
from typing import Any

from gateway.types import ResponseFormat, Tool, ToolCall, ToolChoice

TOOL_CHOICE_MODES = ("auto", "none", "required")


class BadParam(Exception):
    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.message = message
        self.param = param


def structured_fields(body: dict[str, Any]) -> dict[str, Any]:
    """GenerationRequest's response_format, tools, tool_choice and parallel_tool_calls, where the body sets them."""
    fields: dict[str, Any] = {}
    if body.get("response_format") is not None:
        fields["response_format"] = _response_format(body["response_format"])
    if body.get("tools") is not None:
        fields["tools"] = _tools(body["tools"])
    if body.get("tool_choice") is not None:
        fields["tool_choice"] = _tool_choice(body["tool_choice"])
    if body.get("parallel_tool_calls") is not None:
        if not isinstance(body["parallel_tool_calls"], bool):
            raise BadParam("parallel_tool_calls must be true or false", "parallel_tool_calls")
        fields["parallel_tool_calls"] = body["parallel_tool_calls"]
    return fields


def _response_format(value: object) -> ResponseFormat:
    if not isinstance(value, dict) or not isinstance(value.get("type"), str):
        raise BadParam(
            'response_format must be an object such as {"type": "json_object"}; type is text, json_object or '
            "json_schema",
            "response_format",
        )
    if value["type"] != "json_schema":
        return ResponseFormat(value["type"])
    spec = value.get("json_schema")
    if not isinstance(spec, dict) or not isinstance(spec.get("schema", {}), dict):
        raise BadParam(
            'response_format.json_schema must be an object {"name": ..., "schema": {...}, "strict": true}',
            "response_format",
        )
    name, strict = spec.get("name", ""), spec.get("strict") or False
    if not isinstance(name, str) or not isinstance(strict, bool):
        raise BadParam("response_format.json_schema.name must be a string and strict true or false", "response_format")
    schema = json.dumps(spec["schema"]) if "schema" in spec else ""
    return ResponseFormat("json_schema", schema, name, strict)


def _tools(value: object) -> tuple[Tool, ...]:
    if not isinstance(value, list):
        raise BadParam('tools must be a list of {"type": "function", "function": {...}}', "tools")
    tools = []
    for index, tool in enumerate(value):
        function = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(tool, dict) or tool.get("type") != "function" or not isinstance(function, dict):
            raise BadParam(f'tools[{index}] must be {{"type": "function", "function": {{"name": ...}}}}', "tools")
        name, description = function.get("name"), function.get("description", "")
        parameters, strict = function.get("parameters"), function.get("strict") or False
        if not isinstance(name, str) or not isinstance(description, str) or not isinstance(strict, bool):
            raise BadParam(
                f"tools[{index}].function needs a string name (and description), and strict true or false", "tools"
            )
        if parameters is not None and not isinstance(parameters, dict):
            raise BadParam(f"tools[{index}].function.parameters must be a JSON schema object", "tools")
        tools.append(Tool(name, description, json.dumps(parameters) if parameters is not None else "", strict))
    return tuple(tools)


def _tool_choice(value: Any) -> ToolChoice:
    if isinstance(value, str) and value in TOOL_CHOICE_MODES:
        return ToolChoice(value)
    function = value.get("function") if isinstance(value, dict) else None
    if isinstance(function, dict) and value.get("type") == "function" and isinstance(function.get("name"), str):
        return ToolChoice("function", function["name"])
    raise BadParam(
        'tool_choice must be "auto", "none", "required" or {"type": "function", "function": {"name": ...}}',
        "tool_choice",
    )


def message_tool_fields(message: dict[str, Any], index: int) -> dict[str, Any]:
    """ChatMessage's tool_calls (an assistant's) and tool_call_id (a tool's answer), where set."""
    fields: dict[str, Any] = {}
    calls = message.get("tool_calls")
    if calls is not None:
        if not isinstance(calls, list):
            raise BadParam(f"messages[{index}].tool_calls must be a list of tool calls", "messages")
        fields["tool_calls"] = tuple(_call(call, index) for call in calls)
    call_id = message.get("tool_call_id")
    if call_id is not None:
        if not isinstance(call_id, str):
            raise BadParam(f"messages[{index}].tool_call_id must be a string", "messages")
        fields["tool_call_id"] = call_id
    return fields


def _call(call: Any, index: int) -> ToolCall:
    function = call.get("function") if isinstance(call, dict) else None
    if not isinstance(function, dict) or not all(isinstance(function.get(k), str) for k in ("name", "arguments")):
        raise BadParam(
            f'messages[{index}].tool_calls holds a call that is not {{"id": ..., "type": "function", '
            '"function": {"name": ..., "arguments": "<JSON text>"}}',
            "messages",
        )
    return ToolCall(str(call.get("id", "")), function["name"], function["arguments"])


def tool_calls_json(calls: tuple[ToolCall, ...]) -> list[dict[str, Any]]:
    return [{"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}} for c in calls]


def tool_call_deltas(calls: tuple[ToolCall, ...]) -> list[dict[str, Any]]:
    """A stream's delta.tool_calls: each call whole, with its index."""
    return [{"index": index, **call} for index, call in enumerate(tool_calls_json(calls))]
