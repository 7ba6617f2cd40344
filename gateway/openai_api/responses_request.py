"""The body of `POST /v1/responses`, checked field by field into a `ResponsesRequest`; a field that is wrong,
or that asks for what this platform does not do, is an HttpError naming it. Every key is honoured or refused,
never ignored (docs/api-parameters.md, "Responses")."""

import math
from dataclasses import dataclass, field
from typing import Any

from gateway.openai_api.requests import UINT32_MAX, UINT64_MAX, HttpError
from gateway.openai_api.responses_items import MAX_INPUT_ITEMS, input_items
from gateway.openai_api.tools import BadParam
from gateway.openai_api.tools import structured_fields as chat_structured_fields
from gateway.planning.structured import MAX_TOOLS
from gateway.planning.validation import is_client_label
from gateway.types import ResponseFormat, Tool, ToolChoice, as_float32

HONOURED = frozenset(
    {
        "model",
        "input",
        "instructions",
        "max_output_tokens",
        "temperature",
        "top_p",
        "seed",
        "text",
        "tools",
        "tool_choice",
        "parallel_tool_calls",
        "metadata",
        "store",
        "truncation",
        "previous_response_id",
        "background",
        "stream",
        "stream_options",
        "user",
        "prompt_cache_key",
        "service_tier",
        "include",
    }
)
# OpenAI's parameters that this platform does not do: refused by name unless they hold their default.
REFUSED = {
    "reasoning": "no model here reasons before answering; remove reasoning",
    "prompt": "prompt templates are not stored here; send the input itself",
    "conversation": "conversations are not kept here; continue with previous_response_id",
    "context_management": "context management is not offered; set truncation to 'auto' to drop the oldest items",
    "max_tool_calls": "max_tool_calls bounds built-in tool calls, and none are offered here; remove it",
    "top_logprobs": "logprobs are not offered on /v1/responses; use /v1/chat/completions with logprobs",
    "safety_identifier": "safety_identifier is not kept; send user, which labels the request in usage",
    "prompt_cache_retention": "the prefix cache keeps blocks in memory while they are used; remove it",
    "prompt_cache_options": "prompt cache options are not offered; remove prompt_cache_options",
    "moderation": "moderation is not offered; remove it",
    "image": "this platform answers in text only; remove image",
    "access_programs": "access programs are not offered; remove access_programs",
}
KNOWN = HONOURED | frozenset(REFUSED)
SERVICE_TIERS = ("auto", "default")
TRUNCATIONS = ("disabled", "auto")
MAX_METADATA_PAIRS = 16
MAX_METADATA_KEY = 64
MAX_METADATA_VALUE = 512
MAX_INSTRUCTIONS_LENGTH = 4 << 20  # characters; the prompt's byte bound applies too, once rendered
RESPONSE_ID_PREFIX = "resp_"
MAX_RESPONSE_ID_LENGTH = 64
BUILT_IN_TOOLS = frozenset(
    {
        "web_search",
        "web_search_preview",
        "web_search_2025_08_26",
        "web_search_preview_2025_03_11",
        "file_search",
        "code_interpreter",
        "computer",
        "computer_use_preview",
        "image_generation",
        "mcp",
        "local_shell",
        "shell",
        "apply_patch",
        "custom",
        "programmatic_tool_calling",
    }
)
FUNCTION_TOOL_KEYS = frozenset({"type", "name", "description", "parameters", "strict"})


@dataclass(frozen=True)
class ResponsesRequest:
    """A checked `POST /v1/responses`. `tools_json`, `tool_choice_json` and `text_json` are the options as the
    Response object echoes them; the other fields are what the generation runs with."""

    model: str
    items: list[dict[str, Any]]  # the input, as items with ids (responses_items.py)
    instructions: str | None = None
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    seed: int | None = None
    response_format: ResponseFormat | None = None
    tools: tuple[Tool, ...] = ()
    tool_choice: ToolChoice | None = None
    parallel_tool_calls: bool | None = None
    metadata: dict[str, str] = field(default_factory=dict)
    store: bool = True
    background: bool = False
    stream: bool = False
    truncation: str = "disabled"
    previous_response_id: str | None = None
    user: str = ""
    prompt_cache_key: str = ""
    tools_json: list[dict[str, Any]] = field(default_factory=list)
    tool_choice_json: str | dict[str, Any] = "auto"
    text_json: dict[str, Any] = field(default_factory=lambda: {"format": {"type": "text"}, "verbosity": "medium"})

    @property
    def echoed(self) -> dict[str, Any]:
        """The request's options as the stored response keeps them and the Response object shows them."""
        return {
            "instructions": self.instructions,
            "max_output_tokens": self.max_output_tokens,
            "temperature": self.temperature,
            "top_p": self.top_p,
            "seed": self.seed,
            "text": self.text_json,
            "tools": self.tools_json,
            "tool_choice": self.tool_choice_json,
            "parallel_tool_calls": self.parallel_tool_calls,
            "truncation": self.truncation,
            "previous_response_id": self.previous_response_id,
            "user": self.user,
            "prompt_cache_key": self.prompt_cache_key,
            "store": self.store,
            "background": self.background,
        }


def to_responses_request(body: dict[str, Any]) -> ResponsesRequest:
    _refuse_unknown_and_unsupported(body)
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise HttpError("model is required: the name of a model from GET /v1/models", "model")
    store = _flag(body, "store", default=True)
    background = _flag(body, "background", default=False)
    stream = _flag(body, "stream", default=False)
    if background and not store:
        raise HttpError("a background response must be stored: set store to true or remove background", "background")
    if background and stream:
        raise HttpError(
            "streaming a background response is not offered; send stream or background, and poll "
            "GET /v1/responses/{id} for a background one",
            "background",
        )
    _check_stream_options(body, stream)
    tools, tools_json = function_tools(body.get("tools"))
    tool_choice, tool_choice_json = _tool_choice(body.get("tool_choice"))
    response_format, text_json = _text(body.get("text"))
    fields = _structured(response_format, tools, tool_choice, body.get("parallel_tool_calls"))
    return ResponsesRequest(
        model=model,
        items=_input(body.get("input")),
        instructions=_instructions(body.get("instructions")),
        max_output_tokens=_optional_integer(body, "max_output_tokens", 1, UINT32_MAX),
        temperature=_optional_float32(body, "temperature"),
        top_p=_optional_float32(body, "top_p"),
        seed=_optional_integer(body, "seed", 0, UINT64_MAX),
        metadata=_metadata(body.get("metadata")),
        store=store,
        background=background,
        stream=stream,
        truncation=_truncation(body.get("truncation")),
        previous_response_id=_previous_response_id(body.get("previous_response_id")),
        user=_label(body.get("user")),
        prompt_cache_key=_prompt_cache_key(body.get("prompt_cache_key")),
        tools_json=tools_json,
        tool_choice_json=tool_choice_json,
        text_json=text_json,
        **fields,
    )


def _refuse_unknown_and_unsupported(body: dict[str, Any]) -> None:
    for key in body:
        if key not in KNOWN:
            shown = key if len(key) <= 64 else key[:61] + "..."
            param = key if len(key) <= 64 and key.isprintable() else None
            raise HttpError(f"{shown!r} is not a parameter of /v1/responses; remove it", param)
    for name, advice in REFUSED.items():
        if body.get(name) not in (None, {}, [], "", 0, False):
            raise HttpError(advice, name)
    if body.get("service_tier") not in (None, *SERVICE_TIERS):
        raise HttpError(f"service_tier must be one of {', '.join(SERVICE_TIERS)}", "service_tier")
    include = body.get("include")
    if include not in (None, []):
        shown = include[0] if isinstance(include, list) and include and isinstance(include[0], str) else include
        raise HttpError(
            f"include {_shown(shown)} cannot be honoured: no reasoning, built-in tools, images or "
            "logprobs are produced here; remove include",
            "include",
        )


def _flag(body: dict[str, Any], name: str, default: bool) -> bool:
    value = body.get(name)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise HttpError(f"{name} must be true or false", name)
    return value


def _check_stream_options(body: dict[str, Any], stream: bool) -> None:
    options = body.get("stream_options")
    if options is None:
        return
    if not isinstance(options, dict):
        raise HttpError('stream_options must be an object such as {"include_obfuscation": false}', "stream_options")
    if not stream:
        raise HttpError("stream_options is only allowed when stream is true", "stream_options")
    for key, value in options.items():
        if key != "include_obfuscation" or value not in (False, None):
            raise HttpError(
                "stream_options may only hold include_obfuscation: false (no obfuscation is added here)",
                "stream_options",
            )


def _input(value: object) -> list[dict[str, Any]]:
    if isinstance(value, list) and len(value) > MAX_INPUT_ITEMS:
        raise HttpError(f"input holds {len(value)} items; send at most {MAX_INPUT_ITEMS}", "input")
    try:
        return input_items(value)
    except BadParam as error:
        raise HttpError(error.message, error.param) from None


def _instructions(value: object) -> str | None:
    if value is None:
        return None
    if not isinstance(value, str):
        raise HttpError("instructions must be a string: the system message the model reads first", "instructions")
    if len(value) > MAX_INSTRUCTIONS_LENGTH:
        raise HttpError(f"instructions hold {len(value)} characters; shorten them", "instructions")
    return value


def _optional_integer(body: dict[str, Any], name: str, low: int, high: int) -> int | None:
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise HttpError(f"{name} must be an integer from {low} to {high}", name)
    return value


def _optional_float32(body: dict[str, Any], name: str) -> float | None:
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise HttpError(f"{name} must be a number", name)
    return as_float32(float(value))


def _metadata(value: Any) -> dict[str, str]:
    if value is None:
        return {}
    problem = None
    if not isinstance(value, dict) or len(value) > MAX_METADATA_PAIRS:
        problem = f"must be an object of at most {MAX_METADATA_PAIRS} pairs"
    elif any(len(key) > MAX_METADATA_KEY for key in value):
        problem = f"keys must be strings of at most {MAX_METADATA_KEY} characters"
    elif any(not isinstance(v, str) or len(v) > MAX_METADATA_VALUE for v in value.values()):
        problem = f"values must be strings of at most {MAX_METADATA_VALUE} characters"
    if problem:
        raise HttpError(f"metadata {problem}", "metadata")
    return dict(value)


def _truncation(value: object) -> str:
    if value is None:
        return "disabled"
    if not isinstance(value, str) or value not in TRUNCATIONS:
        raise HttpError("truncation must be 'disabled' or 'auto' (drop the oldest items to fit)", "truncation")
    return value


def _previous_response_id(value: object) -> str | None:
    if value is None:
        return None
    if (
        not isinstance(value, str)
        or not value.startswith(RESPONSE_ID_PREFIX)
        or not 5 < len(value) <= MAX_RESPONSE_ID_LENGTH
        or not value.isascii()
        or not value[len(RESPONSE_ID_PREFIX) :].isalnum()
    ):
        raise HttpError("previous_response_id must be the id of a stored response ('resp_...')", "previous_response_id")
    return value


def _label(value: object) -> str:
    """user: the request's label in usage, as on chat completions."""
    if value in (None, ""):
        return ""
    if not isinstance(value, str) or not is_client_label(value):
        raise HttpError(
            "user must be 1 to 128 characters of letters, digits, '_', '.', ':' or '-' (it labels the "
            "request in usage); send a hashed id",
            "user",
        )
    return value


def _prompt_cache_key(value: object) -> str:
    if value is None:
        return ""
    if not isinstance(value, str):
        raise HttpError(
            "prompt_cache_key must be a string naming the session whose prompts share a prefix", "prompt_cache_key"
        )
    return value


def function_tools(value: object) -> tuple[tuple[Tool, ...], list[dict[str, Any]]]:
    """OpenAI's Responses tools (flat: {"type": "function", "name": ...}) in the gateway's types, and as the
    response echoes them (which this reads back the same)."""
    if value is None:
        return (), []
    if not isinstance(value, list):
        raise HttpError('tools must be a list of {"type": "function", "name": ..., "parameters": {...}}', "tools")
    if len(value) > MAX_TOOLS:
        raise HttpError(f"tools holds {len(value)} tools; send at most {MAX_TOOLS}", "tools")
    chat_form, echoed = [], []
    for index, tool in enumerate(value):
        kind = tool.get("type") if isinstance(tool, dict) else None
        if isinstance(kind, str) and kind in BUILT_IN_TOOLS:
            raise HttpError(
                f"tools[{index}] is a {kind} tool; built-in tools are not offered here, only function tools", "tools"
            )
        if kind != "function":
            raise HttpError(f'tools[{index}] must be {{"type": "function", "name": ...}}', "tools")
        unknown = sorted(set(tool) - FUNCTION_TOOL_KEYS)
        if unknown:
            raise HttpError(f"tools[{index}].{unknown[0][:40]} is not offered; remove it", "tools")
        given = ("name", "description", "parameters", "strict")
        function = {key: tool[key] for key in given if tool.get(key) is not None}
        chat_form.append({"type": "function", "function": function})
        echoed.append(
            {
                "type": "function",
                "name": tool.get("name"),
                "description": tool.get("description"),
                "parameters": tool.get("parameters"),
                "strict": tool.get("strict"),
            }
        )
    tools = _chat_structured({"tools": chat_form}).get("tools", ())
    return tools, echoed


def _tool_choice(value: Any) -> tuple[ToolChoice | None, str | dict[str, Any]]:
    if value is None:
        return None, "auto"
    if isinstance(value, str) and value in ("auto", "none", "required"):
        return ToolChoice(value), value
    named = isinstance(value, dict) and value.get("type") == "function" and set(value) == {"type", "name"}
    if named and isinstance(value["name"], str):
        return ToolChoice("function", value["name"]), {"type": "function", "name": value["name"]}
    if isinstance(value, dict) and isinstance(value.get("type"), str) and value["type"] != "function":
        raise HttpError(
            f'tool_choice of type {_shown(value["type"])} is not offered; use "auto", "none", '
            '"required" or {"type": "function", "name": ...}',
            "tool_choice",
        )
    raise HttpError(
        'tool_choice must be "auto", "none", "required" or {"type": "function", "name": ...}', "tool_choice"
    )


def _text(value: object) -> tuple[ResponseFormat | None, dict[str, Any]]:
    """text.format in the chat form (response_format) the planning reads, and text as the response echoes it."""
    if value is None:
        value = {}
    if not isinstance(value, dict) or set(value) - {"format", "verbosity"}:
        raise HttpError('text must be an object such as {"format": {"type": "text"}}', "text")
    if value.get("verbosity") not in (None, "medium"):
        raise HttpError("text.verbosity is not offered; remove it, and bound the answer with max_output_tokens", "text")
    text_format = value.get("format") or {"type": "text"}
    if not isinstance(text_format, dict) or not isinstance(text_format.get("type"), str):
        raise HttpError("text.format must be an object whose type is text, json_object or json_schema", "text")
    kind = text_format["type"]
    echoed = {"format": dict(text_format), "verbosity": "medium"}
    if kind == "json_schema":
        unknown = sorted(set(text_format) - {"type", "name", "schema", "strict", "description"})
        if unknown:
            raise HttpError(f"text.format.{unknown[0][:40]} is not offered; remove it", "text")
        spec = {key: text_format[key] for key in ("name", "schema", "strict", "description") if key in text_format}
        if not isinstance(spec.get("schema"), dict):
            raise HttpError('text.format of type json_schema needs "schema": a JSON schema object', "text")
        response_format = {"type": "json_schema", "json_schema": spec}
    elif kind in ("text", "json_object") and set(text_format) == {"type"}:
        response_format = {"type": kind}
    else:
        raise HttpError("text.format.type must be text, json_object or json_schema", "text")
    parsed = _chat_structured({"response_format": response_format}).get("response_format")
    return (None if kind == "text" else parsed), echoed


def _structured(
    response_format: ResponseFormat | None, tools: tuple[Tool, ...], choice: ToolChoice | None, parallel: object
) -> dict[str, Any]:
    if parallel is not None and not isinstance(parallel, bool):
        raise HttpError("parallel_tool_calls must be true or false", "parallel_tool_calls")
    return {"response_format": response_format, "tools": tools, "tool_choice": choice, "parallel_tool_calls": parallel}


def _chat_structured(fields: dict[str, Any]) -> dict[str, Any]:
    """The chat front's reading of response_format and tools, its errors named as this endpoint names them."""
    try:
        return chat_structured_fields(fields)
    except BadParam as error:
        param = "text" if error.param == "response_format" else error.param
        message = error.message.replace("response_format.json_schema", "text.format").replace(
            "response_format", "text.format"
        )
        raise HttpError(message.replace("].function.", "]."), param) from None


def _shown(value: object) -> str:
    """A client's value, short enough to quote in an error message."""
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."
