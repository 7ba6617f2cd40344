"""Tools (function calling): the grammar a tool call follows, the tools as the chat template takes them, and
the tool calls read back out of the model's text.

A tool call is written `<tool_call>` followed by a JSON list of {"name": ..., "arguments": {...}} (the
built-in chat template shows the model its tools and earlier calls that way). With tool_choice "required"
or a named function, the whole output is such a block; with "auto" the output is either one or text that
does not start with the marker: one Lark grammar holds both, so the model chooses, and a call it starts is
always whole and valid against its tool's parameters. With "none" the output is text.
"""

import json
import uuid
from dataclasses import dataclass
from typing import Any

from diptych_common.grammar import JSON_OPTIONS, LARK_GRAMMAR, Grammar
from gateway.planning.json_body import loads_nested
from gateway.types import Tool, ToolCall

TOOL_CALL_MARKER = "<tool_call>"
MAX_ARGUMENTS_DEPTH = 64  # how deep a call's arguments may nest
_ANY_TEXT = r"TEXT: /(.|\n)*/ & ~/<tool_call>(.|\n)*/"


def calls_schema(tools: tuple[Tool, ...], parallel: bool) -> dict[str, Any]:
    """The JSON schema of a list of calls of `tools` (one call at most unless `parallel`)."""
    calls = [
        {
            "type": "object",
            "properties": {"name": {"const": tool.name}, "arguments": _own_document(tool)},
            "required": ["name", "arguments"],
            "additionalProperties": False,
        }
        for tool in tools
    ]
    schema = {"type": "array", "items": calls[0] if len(calls) == 1 else {"anyOf": calls}, "minItems": 1}
    if not parallel:
        schema["maxItems"] = 1
    return schema


def tool_parameters(tool: Tool) -> dict[str, Any]:
    return json.loads(tool.parameters) if tool.parameters else {"type": "object", "properties": {}}


def _own_document(tool: Tool) -> dict[str, Any]:
    """The tool's parameters as a schema document of their own inside the list of calls: without an `$id`
    their `$ref`s ("#", "#/$defs/...") would point into the list of calls rather than into the parameters
    (a `{"$ref": "#"}` made the list of calls its own arguments, which no parser could finish)."""
    return {"$id": f"urn:diptych:tool:{tool.name}", **tool_parameters(tool)}


def tool_grammar(tools: tuple[Tool, ...], required: bool, parallel: bool, text: dict[str, Any] | None) -> Grammar:
    """The output's grammar: a block of calls of `tools`; unless `required`, or else text (any text that
    does not start with the marker, or a JSON value of the schema `text` when a response_format asks)."""
    calls = json.dumps({**calls_schema(tools, parallel), "x-guidance": JSON_OPTIONS})
    rules = [f'start: {"" if required else "answer | "}"{TOOL_CALL_MARKER}" calls', f"calls: %json {calls}"]
    if not required and text is None:
        rules += ["answer: TEXT", _ANY_TEXT]
    elif text is not None and not required:
        rules.append(f"answer: %json {json.dumps({**text, 'x-guidance': JSON_OPTIONS})}")
    return Grammar(LARK_GRAMMAR, "\n".join(rules))


def template_tools(tools: tuple[Tool, ...]) -> list[dict[str, Any]]:
    """The tools as chat templates take them (`tools=`)."""
    return [
        {
            "type": "function",
            "function": {"name": t.name, "description": t.description, "parameters": tool_parameters(t)},
        }
        for t in tools
    ]


def template_calls(calls: tuple[ToolCall, ...]) -> list[dict[str, Any]]:
    """An assistant message's earlier calls as chat templates take them (arguments as an object); ValueError
    (TooDeep when they nest deeper than MAX_ARGUMENTS_DEPTH) when a call's arguments are not JSON."""
    return [
        {
            "id": c.id,
            "type": "function",
            "function": {"name": c.name, "arguments": loads_nested(c.arguments, MAX_ARGUMENTS_DEPTH)},
        }
        for c in calls
    ]


def parse_calls(text: str, tools: tuple[Tool, ...]) -> tuple[ToolCall, ...]:
    """The calls a whole output makes, or () when it is not a complete, valid block of calls."""
    if not text.startswith(TOOL_CALL_MARKER):
        return ()
    try:
        calls = json.loads(text[len(TOOL_CALL_MARKER) :])
    except ValueError:
        return ()
    names = {tool.name for tool in tools}
    if not isinstance(calls, list) or not all(_is_call(call, names) for call in calls):
        return ()
    return tuple(
        ToolCall(f"call_{uuid.uuid4().hex[:24]}", call["name"], json.dumps(call["arguments"], ensure_ascii=False))
        for call in calls
    )


def _is_call(call: object, names: set[str]) -> bool:
    return isinstance(call, dict) and call.get("name") in names and isinstance(call.get("arguments"), dict)


@dataclass
class ToolCallStream:
    """Holds back the text of a stream while it may be a block of calls: text is passed on once it can no
    longer start with the marker; a block is read at the end."""

    tools: tuple[Tool, ...]
    _held: str = ""
    _text: bool = False  # decided: the answer is text

    def push(self, delta: str) -> str:
        """The part of `delta` that is now safe to send as content."""
        if self._text:
            return delta
        self._held += delta
        if not (self._held.startswith(TOOL_CALL_MARKER) or TOOL_CALL_MARKER.startswith(self._held)):
            self._text = True
            delta, self._held = self._held, ""
            return delta
        return ""

    def end(self, delta: str, cut: bool) -> tuple[str, tuple[ToolCall, ...]]:
        """The last delta: the content still to send, and the calls. Held text that is no valid block is
        content when the output ended of itself (the grammar let it end there as text); when max_tokens `cut`
        it short it may be a call cut off, which is not shown as text (OpenAI's way)."""
        content = self.push(delta)
        calls = parse_calls(self._held, self.tools)
        if not calls and not cut:
            content += self._held
        self._held = ""
        return content, calls
