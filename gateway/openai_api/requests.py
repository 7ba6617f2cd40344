"""OpenAI's request bodies, checked field by field, into the gateway's GenerationRequest; an invalid field is
an HttpError naming it."""

import math
from typing import Any

from gateway.openai_api import params as openai_params
from gateway.openai_api.tools import BadParam, message_tool_fields, structured_fields
from gateway.planning.validation import CHAT_ROLES, MAX_CHOICES, MAX_TOP_LOGPROBS, check_counts, is_client_label
from gateway.types import ChatMessage, GenerationRequest, Priority, as_float32

UINT32_MAX = 2**32 - 1

UINT64_MAX = 2**64 - 1

MAX_CONTENT_PARTS = 1024  # text parts of one message

MAX_COMPLETION_LOGPROBS = 5  # /v1/completions' logprobs: the most likely tokens per token, as OpenAI's

PRIORITIES = {"interactive": Priority.INTERACTIVE, "batch": Priority.BATCH}

PARAMS = (
    "model",
    "prompt",
    "messages",
    "max_tokens",
    "temperature",
    "top_p",
    "top_k",
    "seed",
    "stop",
    "n",
    "priority",
    "idempotency_key",
    "prompt_token_ids",
    "request_id",
    "chat",
    "stream_options",
    "prompt_cache_key",
    "user",
    "presence_penalty",
    "frequency_penalty",
    "logit_bias",
    "logprobs",
    "top_logprobs",
    "response_format",
    "tools",
    "tool_choice",
    "parallel_tool_calls",
)

KNOWN_PARAMS = frozenset(PARAMS) | frozenset(openai_params.EVERY)  # named in the errors of the body's JSON


class HttpError(Exception):
    def __init__(self, message: str, param: str | None = None, status: int = 400) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        self.status = status


def to_generation_request(body: dict[str, Any], chat: bool, idempotency_key: str) -> GenerationRequest:
    model = body.get("model")
    if model is None or model == "":
        raise HttpError("model is required: the name of a model from GET /v1/models", "model")
    if not isinstance(model, str):
        raise HttpError("model must be a string: the name of a model from GET /v1/models", "model")
    check_counts(*(_length(body.get(name)) for name in ("stop", "logit_bias", "tools")))
    fields: dict[str, Any] = {"chat": _chat(body.get("messages"))} if chat else _prompt(body.get("prompt"))
    refused = openai_params.refusal(body, chat)
    if refused is not None:
        raise HttpError(refused.message, refused.param)
    try:
        fields.update(structured_fields(body))
    except BadParam as error:
        raise HttpError(error.message, error.param) from None
    max_tokens_name = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
    if body.get(max_tokens_name) is not None:
        fields["max_tokens"] = _integer(body[max_tokens_name], max_tokens_name, 0, UINT32_MAX)
    fields.update(_choices_and_session(body))
    fields.update(_sampling_controls(body, chat))
    fields.update(_draws(body))
    fields["stop"] = _stop(body.get("stop"))
    if body.get("ignore_eos") is not None:
        fields["ignore_eos"] = flag(body, "ignore_eos")
    priority = body.get("priority", "interactive")
    if not isinstance(priority, str) or priority not in PRIORITIES:
        raise HttpError(f"priority must be one of {', '.join(PRIORITIES)}", "priority")
    return GenerationRequest(model=model, idempotency_key=idempotency_key, priority=PRIORITIES[priority], **fields)


def _draws(body: dict[str, Any]) -> dict[str, Any]:
    """temperature and top_p (at float32 precision, as the gRPC API carries them), top_k and seed."""
    fields: dict[str, Any] = {}
    for name in ("temperature", "top_p"):
        if body.get(name) is not None:
            fields[name] = as_float32(_number(body[name], name))
    if body.get("top_k") is not None:
        fields["top_k"] = _integer(body["top_k"], "top_k", 0, UINT32_MAX)
    if body.get("seed") is not None:
        fields["seed"] = _integer(body["seed"], "seed", 0, UINT64_MAX)
    return fields


def _length(value: object) -> int:
    """How many entries a list or object holds (0 for anything else: its type is checked where it is read)."""
    return len(value) if isinstance(value, (list, dict)) else 0


def _prompt(prompt: object) -> dict[str, Any]:
    """The completion's input: {"prompt": text} or {"prompt_token_ids": ids}."""
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]  # a batch of one
    if isinstance(prompt, str):
        return {"prompt": prompt}
    if isinstance(prompt, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        if any(not 0 <= t <= UINT32_MAX for t in prompt):
            raise HttpError("prompt token ids must be non-negative integers", "prompt")
        return {"prompt_token_ids": list(prompt)}
    if isinstance(prompt, list) and prompt and all(isinstance(p, (str, list)) for p in prompt):
        raise HttpError("send one prompt per request; batches of prompts are not supported", "prompt")
    raise HttpError("prompt is required: a string or a list of token ids", "prompt")


def _chat(messages: object) -> list[ChatMessage]:
    if not isinstance(messages, list) or not messages:
        raise HttpError("messages must be a non-empty list of {role, content} objects", "messages")
    chat = []
    for index, message in enumerate(messages):
        if not isinstance(message, dict):
            raise HttpError(f"messages[{index}] must be an object with role and content", "messages")
        role = message.get("role")
        if not isinstance(role, str) or role not in CHAT_ROLES:
            raise HttpError(f"messages[{index}].role is {_shown(role)}; use one of {', '.join(CHAT_ROLES)}", "messages")
        try:
            tool_fields = message_tool_fields(message, index)
        except BadParam as error:
            raise HttpError(error.message, error.param) from None
        content = message.get("content")
        if content is None and tool_fields.get("tool_calls"):  # an assistant's turn of calls alone
            content = ""
        chat.append(ChatMessage(role, _content(content, index), **tool_fields))
    return chat


def _content(content: object, index: int) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        if len(content) > MAX_CONTENT_PARTS:
            raise HttpError(
                f"messages[{index}].content holds {len(content)} parts; send at most {MAX_CONTENT_PARTS} "
                "(join the text into fewer parts)",
                "messages",
            )
        parts = []
        for part in content:
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise HttpError(f"messages[{index}].content may hold only text parts", "messages")
            parts.append(part["text"])
        return "".join(parts)
    raise HttpError(f"messages[{index}].content must be a string or a list of text parts", "messages")


def _choices_and_session(body: dict[str, Any]) -> dict[str, Any]:
    """n, prompt_cache_key, and user (kept as the request's label in usage)."""
    fields: dict[str, Any] = {}
    if body.get("n") is not None:
        fields["n"] = _integer(body["n"], "n", 1, MAX_CHOICES)
    key = body.get("prompt_cache_key")
    if key is not None:
        if not isinstance(key, str):
            raise HttpError(
                "prompt_cache_key must be a string naming the session whose prompts share a prefix",
                "prompt_cache_key",
            )
        fields["prompt_cache_key"] = key
    user = body.get("user")
    if user not in (None, ""):
        if not isinstance(user, str) or not is_client_label(user):
            raise HttpError(
                "user must be 1 to 128 characters of letters, digits, '_', '.', ':' or '-' (it labels the "
                "request in usage); send a hashed id",
                "user",
            )
        fields["client_request_id"] = user
    return fields


def _sampling_controls(body: dict[str, Any], chat: bool) -> dict[str, Any]:
    """presence_penalty, frequency_penalty, logit_bias, logprobs and top_logprobs, in the gateway's types
    (their bounds are checked in validation.py, for both APIs)."""
    fields: dict[str, Any] = {}
    for name in ("presence_penalty", "frequency_penalty"):
        if body.get(name) is not None:
            fields[name] = as_float32(_number(body[name], name))
    if body.get("logit_bias") is not None:
        fields["logit_bias"] = _logit_bias(body["logit_bias"]) or None
    if chat:
        fields["logprobs"] = flag(body, "logprobs")
        if body.get("top_logprobs") is not None:
            fields["top_logprobs"] = _integer(body["top_logprobs"], "top_logprobs", 0, MAX_TOP_LOGPROBS)
    elif body.get("logprobs") is not None:  # completions: how many of the most likely tokens, 0 to 5
        fields["logprobs"] = True
        fields["top_logprobs"] = _integer(body["logprobs"], "logprobs", 0, MAX_COMPLETION_LOGPROBS)
    return fields


def _logit_bias(bias: object) -> dict[int, float]:
    """OpenAI's {"token id": bias} as {token id: bias}, the bias at float32 precision."""
    if not isinstance(bias, dict):
        raise HttpError('logit_bias must be an object mapping token ids to biases, e.g. {"50256": -100}', "logit_bias")
    parsed = {}
    for key, value in bias.items():
        if not (key.isascii() and key.isdigit()) or len(key) > 10:
            raise HttpError(f"logit_bias keys must be token ids written as integers, got {_shown(key)}", "logit_bias")
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            raise HttpError(
                f"logit_bias values must be numbers from -100 to 100, got {_shown(value)} for token {key}",
                "logit_bias",
            )
        parsed[int(key)] = as_float32(float(value))
    return parsed


def _shown(value: object) -> str:
    """A client's value, short enough to quote in an error message."""
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def _stop(stop: object) -> list[str]:
    if stop is None:
        return []
    if isinstance(stop, str):
        return [stop]
    if isinstance(stop, list) and all(isinstance(s, str) for s in stop):
        return stop
    raise HttpError("stop must be a string or a list of strings", "stop")


def _integer(value: object, name: str, low: int, high: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise HttpError(f"{name} must be an integer from {low} to {high}", name)
    return value


def _number(value: object, name: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise HttpError(f"{name} must be a number", name)
    return float(value)


def flag(body: dict[str, Any], name: str) -> bool:
    value = body.get(name, False)
    if value is None:
        return False
    if not isinstance(value, bool):
        raise HttpError(f"{name} must be true or false", name)
    return value


def stream_options(body: dict[str, Any]) -> tuple[bool, bool]:
    """(include_usage, continuous_usage_stats) of a streamed request; openai_params refused any other key."""
    options = body.get("stream_options") or {}
    if not isinstance(options, dict):
        raise HttpError("stream_options must be an object", "stream_options")
    return flag(options, "include_usage"), flag(options, "continuous_usage_stats")
