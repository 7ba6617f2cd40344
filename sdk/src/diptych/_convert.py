"""Conversions between the generated protobuf messages and the SDK's types."""

from __future__ import annotations

import uuid
from collections.abc import Iterable, Sequence
from typing import Any

from diptych_proto.v1 import inference_pb2 as pb

from ._errors import APIResponseValidationError
from .types import ChatMessageParam, Completion, CompletionChunk, FinishReason, Model, PhaseUsage, Priority, Usage

_FINISH_REASONS: dict[int, FinishReason] = {
    pb.FINISH_REASON_STOP: "stop",
    pb.FINISH_REASON_LENGTH: "length",
}


_PRIORITIES: dict[str, pb.Priority] = {"interactive": pb.PRIORITY_INTERACTIVE, "batch": pb.PRIORITY_BATCH}


def new_idempotency_key() -> str:
    return str(uuid.uuid4())


def prompt_input(prompt: str | Sequence[int]) -> dict[str, object]:
    """The GenerateRequest `input` oneof for a completion prompt: text or token ids."""
    if isinstance(prompt, str):
        return {"prompt": prompt}
    return {"prompt_token_ids": pb.TokenIds(ids=prompt)}


def chat_input(messages: Iterable[ChatMessageParam]) -> dict[str, object]:
    chat = pb.ChatMessages(messages=[pb.ChatMessage(role=m["role"], content=m["content"]) for m in messages])
    return {"chat": chat}


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
    }
    return pb.GenerateRequest(
        model=model,
        idempotency_key=idempotency_key,
        priority=_PRIORITIES[priority],
        ignore_eos=ignore_eos,
        stop=[stop] if isinstance(stop, str) else (stop or []),
        **input_field,
        **{name: value for name, value in sampling.items() if value is not None},
    )


def chunk_from_proto(message: pb.GenerateResponse) -> CompletionChunk:
    """One streamed message; the final one (with a finish reason) must carry usage."""
    finish_reason = _finish_reason(message.finish_reason, message.request_id)
    if finish_reason is not None and not message.HasField("usage"):
        raise APIResponseValidationError(
            "The final message of the stream carries no usage", request_id=message.request_id or None
        )
    return CompletionChunk(
        id=message.request_id,
        text=message.text,
        token_ids=list(message.token_ids),
        finish_reason=finish_reason,
        usage=usage_from_proto(message.usage) if message.HasField("usage") else None,
    )


def completion_from_chunks(chunks: Sequence[CompletionChunk], *, model: str) -> Completion:
    last = chunks[-1] if chunks else None
    if last is None or last.finish_reason is None or last.usage is None:
        raise APIResponseValidationError(
            "The response stream ended without a final message carrying finish_reason and usage",
            request_id=last.id if last else None,
        )
    return Completion(
        id=last.id,
        model=model,
        text="".join(chunk.text for chunk in chunks),
        token_ids=[token_id for chunk in chunks for token_id in chunk.token_ids],
        finish_reason=last.finish_reason,
        usage=last.usage,
    )


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
