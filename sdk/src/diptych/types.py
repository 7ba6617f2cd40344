"""The typed objects the API returns, and the shape of chat messages it accepts."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, TypedDict

__all__ = [
    "ChatMessageParam",
    "Completion",
    "CompletionChunk",
    "FinishReason",
    "Model",
    "PhaseUsage",
    "Usage",
]

FinishReason = Literal["stop", "length"]
""""stop": end of sequence or a stop string; "length": max_tokens or the context length reached."""


class ChatMessageParam(TypedDict):
    role: Literal["system", "user", "assistant"]
    content: str


@dataclass(frozen=True, slots=True)
class PhaseUsage:
    """What one phase (prefill or decode) of the request cost, and where it ran."""

    tokens: int
    cached_tokens: int
    kv_bytes: int
    compute_ms: int
    worker_id: str


@dataclass(frozen=True, slots=True)
class Usage:
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    total_tokens: int
    prefill: PhaseUsage | None = None
    decode: PhaseUsage | None = None


@dataclass(frozen=True, slots=True)
class Completion:
    id: str
    model: str
    text: str
    token_ids: list[int]
    finish_reason: FinishReason
    usage: Usage


@dataclass(frozen=True, slots=True)
class CompletionChunk:
    """One streamed delta; `finish_reason` and `usage` are set on the last chunk only."""

    id: str
    text: str
    token_ids: list[int]
    finish_reason: FinishReason | None = None
    usage: Usage | None = None


@dataclass(frozen=True, slots=True)
class Model:
    id: str
    context_length: int
    has_chat_template: bool
