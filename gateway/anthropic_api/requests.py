"""Anthropic's request bodies, checked field by field, into the gateway's GenerationRequest: the conversation
as a chat (`conversation.py`), `max_tokens`, `stop_sequences`, `temperature` / `top_p` / `top_k`, client tools
and `tool_choice` (onto the tools of the chat API: the same grammar, the same calls read back), and
`metadata.user_id` (the request's label in usage, as the chat API's `user`). An invalid field is a
BadRequest naming it."""

import json
import math
import re
from dataclasses import dataclass
from typing import Any, TypeGuard

from gateway.anthropic_api import conversation
from gateway.anthropic_api.conversation import CacheMark, Conversation, cache_mark, chat_messages, cut_after, only
from gateway.anthropic_api.params import COUNT_TOKENS, MESSAGES, BadRequest, check_keys, shown
from gateway.planning.structured import MAX_TOOLS
from gateway.planning.validation import MAX_STOP_LENGTH, MAX_STOP_STRINGS, is_client_label
from gateway.types import ChatMessage, GenerationRequest, Tool, ToolChoice, as_float32

UINT32_MAX = 2**32 - 1
FLOAT_MAX = 1.7976931348623157e308
MAX_TEMPERATURE = 1.0  # Anthropic's range, 0 to 1
TOOL_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")
TOOL_FIELDS = (
    "type",
    "name",
    "description",
    "input_schema",
    "cache_control",
    "strict",  # every call follows its schema here (a grammar), so strict asks for nothing more
    "defer_loading",
    "eager_input_streaming",
    "input_examples",
    "allowed_callers",
)
TOOL_CHOICES = {"auto": "auto", "any": "required", "tool": "function", "none": "none"}  # -> the chat API's modes


@dataclass(frozen=True)
class MessagesRequest:
    generation: GenerationRequest
    stream: bool
    # The conversation cut after its last cache_control mark: its prompt's tokens shared with the whole
    # prompt are the prefix the mark asks to cache (None: no mark).
    cache_prefix: GenerationRequest | None


def messages_request(body: dict[str, Any], idempotency_key: str) -> MessagesRequest:
    check_keys(body, MESSAGES, "/v1/messages")
    model = _model(body.get("model"))
    max_tokens = _max_tokens(body.get("max_tokens"))
    stop = _stop_sequences(body.get("stop_sequences"))
    tools, tool_marks = _tools(body.get("tools"))
    request_mark = cache_mark(body.get("cache_control"), "cache_control")
    asked = conversation.read(body.get("system"), body.get("messages"), tool_marks, request_mark)
    generation = GenerationRequest(
        model=model,
        chat=chat_messages(asked.turns),
        max_tokens=max_tokens,
        stop=stop,
        idempotency_key=idempotency_key,
        tools=tools,
        **_tool_choice(body.get("tool_choice"), tools),
        **_sampling(body),
        **_metadata(body.get("metadata")),
    )
    return MessagesRequest(generation, _flag(body.get("stream"), "stream"), _cache_prefix(generation, asked))


def count_tokens_request(body: dict[str, Any]) -> GenerationRequest:
    """The conversation to count the prompt tokens of. tool_choice is checked but not compiled: the chat
    template shows the model the tools whatever it says, so the count is the same."""
    check_keys(body, COUNT_TOKENS, "/v1/messages/count_tokens")
    model = _model(body.get("model"))
    tools, tool_marks = _tools(body.get("tools"))
    request_mark = cache_mark(body.get("cache_control"), "cache_control")
    asked = conversation.read(body.get("system"), body.get("messages"), tool_marks, request_mark)
    _tool_choice(body.get("tool_choice"), tools)
    return _rendered_only(model, chat_messages(asked.turns), tools)


def _cache_prefix(generation: GenerationRequest, asked: Conversation) -> GenerationRequest | None:
    mark = asked.last_mark
    if mark is None:
        return None
    tools = generation.tools if mark.in_turns else generation.tools[: mark.index + 1]
    chat = chat_messages(cut_after(asked.turns, mark)) or [ChatMessage("user", "")]  # a chat holds a message
    return _rendered_only(generation.model, chat, tools)


def _rendered_only(model: str, chat: list[ChatMessage], tools: tuple[Tool, ...]) -> GenerationRequest:
    """A request whose plan only renders and tokenizes the chat with its tools (no grammar is compiled)."""
    return GenerationRequest(model=model, chat=chat, tools=tools, tool_choice=ToolChoice("none") if tools else None)


def _model(model: object) -> str:
    if not isinstance(model, str) or not model:
        raise BadRequest("model is required: the name of a model from GET /v1/models")
    return model


def _max_tokens(value: object) -> int:
    if value is None:
        raise BadRequest("max_tokens is required: the most tokens the answer may hold")
    if value == 0 and _is_int(value):
        raise BadRequest("max_tokens 0 (warming the cache without an answer) is not served; send at least 1")
    return _integer(value, "max_tokens", 1, UINT32_MAX)


def _stop_sequences(value: object) -> list[str]:
    if value is None:
        return []
    if not isinstance(value, list) or not all(isinstance(s, str) for s in value):
        raise BadRequest("stop_sequences must be a list of strings")
    if len(value) > MAX_STOP_STRINGS:
        raise BadRequest(f"stop_sequences holds {len(value)} strings; send at most {MAX_STOP_STRINGS}")
    if any(not 1 <= len(s) <= MAX_STOP_LENGTH for s in value):
        raise BadRequest(f"each of stop_sequences must be 1 to {MAX_STOP_LENGTH} characters long")
    return value


def _tools(value: object) -> tuple[tuple[Tool, ...], list[CacheMark]]:
    """The client tools, and the cache marks among them."""
    if value is None:
        return (), []
    if not isinstance(value, list):
        raise BadRequest("tools must be a list of {name, description, input_schema} objects")
    if len(value) > MAX_TOOLS:
        raise BadRequest(f"tools holds {len(value)} tools; send at most {MAX_TOOLS}")
    tools, marks, names = [], [], set()
    for index, entry in enumerate(value):
        tool = _tool(entry, f"tools[{index}]")
        if tool.name in names:
            raise BadRequest(f"tools[{index}].name {shown(tool.name)} is given twice; name each tool once")
        names.add(tool.name)
        tools.append(tool)
        if cache_mark(entry.get("cache_control"), f"tools[{index}].cache_control"):
            marks.append(CacheMark(False, index))
    return tuple(tools), marks


def _tool(entry: object, where: str) -> Tool:
    if not isinstance(entry, dict):
        raise BadRequest(f"{where} must be an object {{name, description, input_schema}}")
    if entry.get("type") not in (None, "custom"):
        raise BadRequest(
            f"{where} is a server tool ({shown(entry.get('type'))}): server tools are not served; send client "
            "tools (name, description, input_schema) and run them yourself"
        )
    only(entry, TOOL_FIELDS, where)
    name, description, schema = entry.get("name"), entry.get("description", ""), entry.get("input_schema")
    if not isinstance(name, str) or not TOOL_NAME.fullmatch(name):
        raise BadRequest(f"{where}.name must be 1 to 64 letters, digits, '_' or '-'")
    if not isinstance(description, str):
        raise BadRequest(f"{where}.description must be a string")
    if not isinstance(schema, dict):
        raise BadRequest(f"{where}.input_schema is required: the JSON schema of the tool's input, an object")
    strict = _flag(entry.get("strict"), f"{where}.strict")
    for field, off, advice in (
        ("defer_loading", (None, False), "tool search is not served"),
        ("eager_input_streaming", (None, False), "a call's input is streamed once whole"),
        ("input_examples", (None, []), "input examples are not served"),
        ("allowed_callers", (None, ["direct"]), "only direct calls are served"),
    ):
        if entry.get(field) not in off:
            raise BadRequest(f"{where}.{field}: {advice}; remove it")
    return Tool(name, description, json.dumps(schema), strict)


def _tool_choice(value: Any, tools: tuple[Tool, ...]) -> dict[str, Any]:
    """GenerationRequest's tool_choice and parallel_tool_calls. With no tools, auto and none ask nothing."""
    if value is None:
        return {}
    kind = value.get("type") if isinstance(value, dict) else None
    if not isinstance(kind, str) or kind not in TOOL_CHOICES:
        raise BadRequest(
            'tool_choice must be {"type": "auto"}, {"type": "any"}, {"type": "tool", "name": ...} or {"type": "none"}'
        )
    only(value, ("type", "name", "disable_parallel_tool_use") if kind != "none" else ("type",), "tool_choice")
    name = value.get("name", "")
    if kind == "tool" and (not isinstance(name, str) or not name):
        raise BadRequest('tool_choice {"type": "tool"} needs the name of the tool to call')
    if kind != "tool" and "name" in value:
        raise BadRequest(f'tool_choice.name names a tool only with {{"type": "tool"}}, not {shown(kind)}')
    disable = _flag(value.get("disable_parallel_tool_use"), "tool_choice.disable_parallel_tool_use")
    if not tools and kind in ("auto", "none"):
        return {}
    fields: dict[str, Any] = {"tool_choice": ToolChoice(TOOL_CHOICES[kind], name)}
    if disable and tools:
        fields["parallel_tool_calls"] = False
    return fields


def _sampling(body: dict[str, Any]) -> dict[str, Any]:
    """temperature, top_p and top_k, at the precision the gRPC contract carries them."""
    fields: dict[str, Any] = {}
    temperature = body.get("temperature")
    if temperature is not None:
        if not _is_number(temperature) or not 0 <= temperature <= MAX_TEMPERATURE:
            raise BadRequest(f"temperature must be a number from 0 to {MAX_TEMPERATURE:g} (0 is greedy)")
        fields["temperature"] = as_float32(float(temperature))
    if body.get("top_p") is not None:
        if not _is_number(body["top_p"]):
            raise BadRequest("top_p must be a number greater than 0 and at most 1")
        fields["top_p"] = as_float32(float(body["top_p"]))
    if body.get("top_k") is not None:
        fields["top_k"] = _integer(body["top_k"], "top_k", 0, UINT32_MAX)
    return fields


def _metadata(metadata: object) -> dict[str, Any]:
    """metadata.user_id labels the request in usage (GenerationRequest.client_request_id)."""
    if metadata is None:
        return {}
    if not isinstance(metadata, dict):
        raise BadRequest('metadata must be an object such as {"user_id": "..."}')
    only(metadata, ("user_id",), "metadata")
    user_id = metadata.get("user_id")
    if user_id in (None, ""):
        return {}
    if not isinstance(user_id, str) or not is_client_label(user_id):
        raise BadRequest(
            "metadata.user_id must be 1 to 128 characters of letters, digits, '_', '.', ':' or '-' (it labels the "
            "request in usage); send a hashed id"
        )
    return {"client_request_id": user_id}


def _flag(value: object, name: str) -> bool:
    if value is None:
        return False
    if not isinstance(value, bool):
        raise BadRequest(f"{name} must be true or false")
    return value


def _integer(value: object, name: str, low: int, high: int) -> int:
    if not _is_int(value) or not low <= value <= high:
        raise BadRequest(f"{name} must be an integer from {low} to {high}")
    return value


def _is_int(value: object) -> TypeGuard[int]:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: object) -> bool:
    """A finite number that a float holds (an integer of 400 digits does not)."""
    if _is_int(value):
        return abs(value) <= FLOAT_MAX
    return isinstance(value, float) and math.isfinite(value)
