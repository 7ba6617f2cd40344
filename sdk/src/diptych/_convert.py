"""Conversions between the generated protobuf messages and the SDK's types."""

from __future__ import annotations

import dataclasses
import json
import re
import uuid
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from google.protobuf import json_format
from google.protobuf.message import Message

from diptych_proto.v1 import inference_pb2 as pb

from ._errors import APIResponseValidationError
from .types import (
    ChatCompletionMessage,
    Choice,
    Completion,
    CompletionChunk,
    FinishReason,
    FunctionCall,
    MessageParam,
    Model,
    PhaseUsage,
    Priority,
    ResponseFormatParam,
    TokenLogprob,
    ToolCall,
    ToolChoiceParam,
    ToolParam,
    TopLogprob,
    Usage,
)

_FINISH_REASONS: dict[int, FinishReason] = {
    pb.FINISH_REASON_STOP: "stop",
    pb.FINISH_REASON_LENGTH: "length",
    pb.FINISH_REASON_TOOL_CALLS: "tool_calls",
    pb.FINISH_REASON_INTERRUPTED: "interrupted",
}


_PRIORITIES: dict[str, pb.Priority] = {"interactive": pb.PRIORITY_INTERACTIVE, "batch": pb.PRIORITY_BATCH}

_METADATA_NAME = re.compile(r"[0-9a-z_.-]+")
_CLIENT_LABEL = re.compile(r"[A-Za-z0-9_.:-]{1,128}")  # what the gateway keeps as a request's label
_ROLES = ("system", "developer", "user", "assistant", "tool")
_SERVICE_TIERS = ("auto", "default")
_STREAM_OPTIONS = ("include_usage", "continuous_usage_stats")


def new_idempotency_key() -> str:
    return str(uuid.uuid4())


def prompt_input(prompt: str | Sequence[int]) -> dict[str, object]:
    """The GenerateRequest `input` oneof for a completion prompt: text or token ids."""
    if isinstance(prompt, str):
        return {"prompt": prompt}
    return {"prompt_token_ids": pb.TokenIds(ids=prompt)}


def chat_input(messages: Iterable[MessageParam]) -> dict[str, object]:
    if isinstance(messages, (str, bytes, Mapping)):
        raise ValueError("messages must be a list of messages such as {'role': 'user', 'content': 'Hi'}")
    return {"chat": pb.ChatMessages(messages=[_chat_message(m, index) for index, m in enumerate(messages)])}


def _chat_message(message: MessageParam, index: int) -> pb.ChatMessage:
    """One message, checked here: `messages` takes any mapping, whose keys no type checker vouches for."""
    if not isinstance(message, Mapping):
        raise ValueError(f"messages[{index}] must be a mapping with role and content, not {type(message).__name__}")
    role = message.get("role")
    if role not in _ROLES:
        raise ValueError(f"messages[{index}].role is {role!r}; use one of {', '.join(_ROLES)}")
    tool_call_id = message.get("tool_call_id", "")
    if not isinstance(tool_call_id, str):
        raise ValueError(f"messages[{index}].tool_call_id must be a string")
    return pb.ChatMessage(
        role=role,
        content=_content(message.get("content"), index),
        tool_calls=_message_tool_calls(message.get("tool_calls"), index),
        tool_call_id=tool_call_id,
    )


def _content(content: object, index: int) -> str:
    """A message's text: a string, None (an assistant's turn of tool calls alone) or OpenAI's text parts."""
    if content is None or isinstance(content, str):
        return content or ""
    if isinstance(content, list) and all(
        isinstance(part, Mapping) and part.get("type") == "text" and isinstance(part.get("text"), str)
        for part in content
    ):
        return "".join(part["text"] for part in content)
    raise ValueError(f"messages[{index}].content must be a string, None or a list of text parts")


def _message_tool_calls(calls: object, index: int) -> list[pb.ToolCall]:
    if calls is None:
        return []
    try:
        return [
            pb.ToolCall(id=call["id"], name=call["function"]["name"], arguments=call["function"]["arguments"])
            for call in calls  # type: ignore[attr-defined]
        ]
    except (KeyError, TypeError):
        raise ValueError(
            f"messages[{index}].tool_calls must be a list of {{'id', 'type': 'function', 'function': "
            "{'name', 'arguments'}}} objects"
        ) from None


def max_tokens_of(max_tokens: int | None, max_completion_tokens: int | None) -> int | None:
    """`max_completion_tokens` (OpenAI's newer name) or `max_tokens`: the gRPC API's max_tokens."""
    if None not in (max_tokens, max_completion_tokens) and max_tokens != max_completion_tokens:
        raise ValueError("max_tokens and max_completion_tokens differ; give one of them")
    return max_completion_tokens if max_completion_tokens is not None else max_tokens


def client_label(user: str | None) -> str:
    """`user`, OpenAI's end-user id: the gateway keeps it as the request's label in usage (`request_id`)."""
    if user is None or user == "":
        return ""
    if not isinstance(user, str) or not _CLIENT_LABEL.fullmatch(user):
        raise ValueError(
            "user must be 1 to 128 characters of letters, digits, '_', '.', ':' or '-' (it labels the request in "
            "usage); send a hashed id"
        )
    return user


def check_stream_options(stream_options: Mapping[str, object] | None, stream: bool) -> None:
    """The gRPC API always sends usage with a stream's last chunk and only there: stream_options may ask for that."""
    if stream_options is None:
        return
    if not stream:
        raise ValueError("stream_options is only allowed with stream=True")
    if not isinstance(stream_options, Mapping):
        raise ValueError('stream_options must be a mapping such as {"include_usage": True}')
    unknown = [name for name in stream_options if name not in _STREAM_OPTIONS]
    if unknown:
        raise ValueError(f"stream_options.{unknown[0]} is not supported; only {' and '.join(_STREAM_OPTIONS)} are")
    if stream_options.get("include_usage", True) is not True:
        raise ValueError(
            "stream_options.include_usage cannot be false: the stream's last chunk always carries usage "
            "(stream.usage holds it too)"
        )
    if stream_options.get("continuous_usage_stats", False) is not False:
        raise ValueError(
            "stream_options.continuous_usage_stats is not available over gRPC: only the stream's last chunk "
            "carries usage (the gateway's HTTP API sends it on every chunk)"
        )


def check_chat_only_options(metadata: Mapping[str, str] | None, service_tier: str | None) -> None:
    """OpenAI's `metadata` labels stored completions, which this platform does not keep; every request is served
    at the default tier. Their empty or default values are accepted, as the gateway's HTTP API accepts them."""
    if metadata:
        raise ValueError("completions are not stored, so metadata has nothing to label; remove it (or send user)")
    if service_tier is not None and service_tier not in _SERVICE_TIERS:
        raise ValueError(
            f"service_tier must be one of {', '.join(_SERVICE_TIERS)}; send priority='batch' to be served after "
            "interactive requests"
        )


def check_no_query(extra_query: Mapping[str, object] | None) -> None:
    """A gRPC call has no URL, so there is nowhere to send `extra_query`; refusing beats dropping it."""
    if extra_query:
        raise ValueError(
            "extra_query: gRPC calls have no query string; set the request's fields with extra_body "
            "(or call the gateway's HTTP API)"
        )


def structured_input(
    response_format: ResponseFormatParam | None,
    tools: Iterable[ToolParam] | None,
    tool_choice: str | ToolChoiceParam | None,
    parallel_tool_calls: bool | None,
) -> dict[str, Any]:
    """GenerateRequest's response_format, tools and tool_choice (which carries parallel_tool_calls)."""
    fields: dict[str, Any] = {}
    if response_format is not None:
        spec = response_format.get("json_schema")
        fields["response_format"] = pb.ResponseFormat(
            type=response_format["type"],
            json_schema=json.dumps(spec["schema"]) if spec and "schema" in spec else "",
            name=spec.get("name", "") if spec else "",
            strict=bool(spec.get("strict")) if spec else False,
        )
    if tools is not None:
        fields["tools"] = [_tool(tool) for tool in tools]
    if tool_choice is not None or parallel_tool_calls is not None:
        choice = pb.ToolChoice()
        if isinstance(tool_choice, str):
            choice.mode = tool_choice
        elif tool_choice is not None:
            choice.mode, choice.function_name = "function", tool_choice["function"]["name"]
        if parallel_tool_calls is not None:
            choice.parallel_tool_calls = parallel_tool_calls
        fields["tool_choice"] = choice
    return fields


def _tool(tool: ToolParam) -> pb.Tool:
    function = tool["function"]
    parameters = function.get("parameters")
    return pb.Tool(
        name=function["name"],
        description=function.get("description", ""),
        parameters=json.dumps(parameters) if parameters is not None else "",
        strict=bool(function.get("strict")),
    )


def generate_request(
    *,
    model: str,
    input_field: dict[str, Any],
    idempotency_key: str,
    max_tokens: int | None = None,
    temperature: float | None = None,
    top_p: float | None = None,
    top_k: int | None = None,
    seed: int | None = None,
    stop: str | Sequence[str] | None = None,
    priority: Priority = "interactive",
    ignore_eos: bool = False,
    n: int | None = None,
    prompt_cache_key: str | None = None,
    presence_penalty: float | None = None,
    frequency_penalty: float | None = None,
    logit_bias: Mapping[int | str, float] | None = None,
    logprobs: bool = False,
    top_logprobs: int | None = None,
    structured: dict[str, Any] | None = None,
    client_label: str = "",
    extra_body: Mapping[str, object] | None = None,
) -> pb.GenerateRequest:
    if priority not in _PRIORITIES:
        raise ValueError(f"priority must be 'interactive' or 'batch', not {priority!r}")
    if not isinstance(idempotency_key, str) or not idempotency_key or len(idempotency_key) > 255:
        raise ValueError("idempotency_key must be a non-empty string of at most 255 characters")
    sampling: dict[str, Any] = {
        "max_tokens": max_tokens,
        "temperature": temperature,
        "top_p": top_p,
        "top_k": top_k,
        "seed": seed,
        "n": n,
        "prompt_cache_key": prompt_cache_key,
        "presence_penalty": presence_penalty,
        "frequency_penalty": frequency_penalty,
        "top_logprobs": top_logprobs,
    }
    request = pb.GenerateRequest(
        model=model,
        idempotency_key=idempotency_key,
        request_id=client_label,
        priority=_PRIORITIES[priority],
        ignore_eos=ignore_eos,
        logit_bias=_logit_bias(logit_bias),
        logprobs=logprobs,
        stop=[stop] if isinstance(stop, str) else (stop or []),
        **input_field,
        **(structured or {}),
        **{name: value for name, value in sampling.items() if value is not None},
    )
    if extra_body:
        merge_extra_body(request, extra_body)
    return request


def merge_extra_body(request: Message, extra_body: Mapping[str, object]) -> None:
    """Sets the request's fields `extra_body` names (over the arguments' values). gRPC carries only the
    fields of the contract, so a name it does not have is refused here rather than silently dropped."""
    name = request.DESCRIPTOR.name
    known = [field.name for field in request.DESCRIPTOR.fields]
    unknown = [field for field in extra_body if field not in known]
    if unknown:
        has = f"it has {', '.join(known)}" if known else "it has no fields"
        raise ValueError(f"extra_body: the API's {name} has no field {', '.join(unknown)} ({has})")
    try:
        json_format.ParseDict(dict(extra_body), request)
    except json_format.ParseError as error:
        raise ValueError(f"extra_body: {str(error).splitlines()[0]}") from None


def call_metadata(
    metadata: tuple[tuple[str, str], ...], extra_headers: Mapping[str, str] | None
) -> tuple[tuple[str, str], ...]:
    """The client's metadata with the caller's `extra_headers` added; a name in both takes the caller's value.

    gRPC metadata names are lower case (HTTP/2), so names are lowered; a name gRPC cannot carry is refused."""
    if not extra_headers:
        return metadata
    extra: dict[str, str] = {}
    for name, value in extra_headers.items():
        key = name.lower() if isinstance(name, str) else ""
        if not _METADATA_NAME.fullmatch(key) or key.startswith("grpc-") or key.endswith("-bin"):
            raise ValueError(f"extra_headers: {name!r} is not a name gRPC metadata can carry as text")
        if not isinstance(value, str) or not value.isprintable() or not value.isascii():
            raise ValueError(f"extra_headers: the value of {name!r} must be printable ASCII text, not {value!r}")
        extra[key] = value
    return tuple((key, value) for key, value in metadata if key not in extra) + tuple(extra.items())


def _logit_bias(bias: Mapping[int | str, float] | None) -> dict[int, float]:
    """{token id: bias}; the ids may be written as strings, as OpenAI's are."""
    parsed = {}
    for key, value in (bias or {}).items():
        try:
            token_id = int(key)
        except (TypeError, ValueError):
            raise ValueError(f"logit_bias keys must be token ids, not {key!r}") from None
        if token_id < 0:
            raise ValueError(f"logit_bias keys must be token ids, not {key!r}")
        parsed[token_id] = float(value)
    return parsed


def _logprobs(message: pb.GenerateResponse) -> list[TokenLogprob] | None:
    if not message.logprobs:
        return None
    return [
        TokenLogprob(
            token=entry.token,
            token_id=entry.token_id,
            logprob=entry.logprob,
            top_logprobs=[TopLogprob(t.token, t.token_id, t.logprob) for t in entry.top_logprobs],
        )
        for entry in message.logprobs
    ]


def chunk_from_proto(message: pb.GenerateResponse) -> CompletionChunk:
    """One streamed message; usage comes with a finish reason (the last choice to end) or not at all."""
    finish_reason = _finish_reason(message.finish_reason, message.request_id)
    if finish_reason is None and message.HasField("usage"):
        raise APIResponseValidationError(
            "A message carries usage but no finish_reason", request_id=message.request_id or None
        )
    return CompletionChunk(
        id=message.request_id,
        text=message.text,
        token_ids=list(message.token_ids),
        finish_reason=finish_reason,
        usage=usage_from_proto(message.usage) if message.HasField("usage") else None,
        index=message.index,
        logprobs=_logprobs(message),
        tool_calls=[ToolCall(c.id, FunctionCall(c.name, c.arguments)) for c in message.tool_calls] or None,
    )


def completion_from_chunks(chunks: Sequence[CompletionChunk], *, model: str, chat: bool = False) -> Completion:
    """The whole answer: every choice's chunks joined; the last chunk carries the request's usage. A chat
    answer's choices also carry it as a `message`."""
    last = chunks[-1] if chunks else None
    if last is None or last.finish_reason is None or last.usage is None:
        raise APIResponseValidationError(
            "The response stream ended without a final message carrying finish_reason and usage",
            request_id=last.id if last else None,
        )
    choices = [_choice(index, [c for c in chunks if c.index == index], last.id) for index in _indexes(chunks)]
    if chat:
        choices = [dataclasses.replace(choice, message=_message(choice)) for choice in choices]
    first = choices[0]
    return Completion(
        id=last.id,
        model=model,
        text=first.text,
        token_ids=first.token_ids,
        finish_reason=first.finish_reason,
        usage=last.usage,
        choices=choices,
        logprobs=first.logprobs,
        tool_calls=first.tool_calls,
    )


def _indexes(chunks: Sequence[CompletionChunk]) -> list[int]:
    indexes = sorted({chunk.index for chunk in chunks})
    if indexes != list(range(len(indexes))):
        raise APIResponseValidationError(
            f"The response's choices are {indexes}, not 0 to n-1", request_id=chunks[-1].id
        )
    return indexes


def _choice(index: int, chunks: list[CompletionChunk], request_id: str) -> Choice:
    finish_reason = chunks[-1].finish_reason
    if finish_reason is None:
        raise APIResponseValidationError(f"Choice {index} ended without a finish_reason", request_id=request_id)
    return Choice(
        index=index,
        text="".join(chunk.text for chunk in chunks),
        token_ids=[token_id for chunk in chunks for token_id in chunk.token_ids],
        finish_reason=finish_reason,
        logprobs=_joined_logprobs(chunks),
        tool_calls=chunks[-1].tool_calls,
    )


def _message(choice: Choice) -> ChatCompletionMessage:
    content = None if choice.tool_calls and not choice.text else choice.text
    return ChatCompletionMessage(role="assistant", content=content, tool_calls=choice.tool_calls)


def _joined_logprobs(chunks: list[CompletionChunk]) -> list[TokenLogprob] | None:
    if all(chunk.logprobs is None for chunk in chunks):
        return None
    return [entry for chunk in chunks for entry in chunk.logprobs or ()]


def usage_from_proto(usage: pb.Usage) -> Usage:
    return Usage(
        prompt_tokens=usage.prompt_tokens,
        completion_tokens=usage.completion_tokens,
        cached_tokens=usage.cached_tokens,
        total_tokens=usage.prompt_tokens + usage.completion_tokens,
        prefill=_phase_usage(usage.prefill) if usage.HasField("prefill") else None,
        decode=_phase_usage(usage.decode) if usage.HasField("decode") else None,
    )


def model_from_proto(model: pb.Model) -> Model:
    return Model(id=model.id, context_length=model.context_length, has_chat_template=model.has_chat_template)


def _phase_usage(phase: pb.PhaseUsage) -> PhaseUsage:
    return PhaseUsage(
        tokens=phase.tokens,
        cached_tokens=phase.cached_tokens,
        kv_bytes=phase.kv_bytes,
        compute_ms=phase.compute_ms,
        worker_id=phase.worker_id,
    )


def _finish_reason(value: int, request_id: str) -> FinishReason | None:
    if value == pb.FINISH_REASON_UNSPECIFIED:
        return None
    try:
        return _FINISH_REASONS[value]
    except KeyError:
        raise APIResponseValidationError(f"Unknown finish_reason {value}", request_id=request_id or None) from None
