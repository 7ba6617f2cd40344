"""Conversions between the generated protobuf messages and the SDK's types."""

from __future__ import annotations

import dataclasses
import json
import re
import uuid
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from google.protobuf import json_format

from diptych_proto.v1 import inference_pb2 as pb

from ._errors import APIResponseValidationError
from .types import (
    ChatCompletionMessage,
    ChatMessageParam,
    Choice,
    Completion,
    CompletionChunk,
    FinishReason,
    FunctionCall,
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


def new_idempotency_key() -> str:
    return str(uuid.uuid4())


def prompt_input(prompt: str | Sequence[int]) -> dict[str, object]:
    """The GenerateRequest `input` oneof for a completion prompt: text or token ids."""
    if isinstance(prompt, str):
        return {"prompt": prompt}
    return {"prompt_token_ids": pb.TokenIds(ids=prompt)}


def chat_input(messages: Iterable[ChatMessageParam]) -> dict[str, object]:
    return {"chat": pb.ChatMessages(messages=[_chat_message(m) for m in messages])}


def _chat_message(message: ChatMessageParam) -> pb.ChatMessage:
    calls = [
        pb.ToolCall(id=c["id"], name=c["function"]["name"], arguments=c["function"]["arguments"])
        for c in message.get("tool_calls", ())
    ]
    return pb.ChatMessage(
        role=message["role"],
        content=message.get("content") or "",
        tool_calls=calls,
        tool_call_id=message.get("tool_call_id", ""),
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
        _merge_extra_body(request, extra_body)
    return request


def _merge_extra_body(request: pb.GenerateRequest, extra_body: Mapping[str, object]) -> None:
    """Sets the GenerateRequest fields `extra_body` names (over the arguments' values). gRPC carries only the
    fields of the contract, so a name it does not have is refused here rather than silently dropped."""
    known = [field.name for field in pb.GenerateRequest.DESCRIPTOR.fields]
    unknown = [name for name in extra_body if name not in known]
    if unknown:
        raise ValueError(
            f"extra_body: the API's GenerateRequest has no field {', '.join(unknown)} (it has {', '.join(known)})"
        )
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
