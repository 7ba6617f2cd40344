"""The typed objects the API returns, and the shape of chat messages it accepts."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import date, datetime
from typing import Generic, Literal, TypedDict, TypeVar

__all__ = [
    "ApiKey",
    "BillingSummary",
    "DailyUsage",
    "Invoice",
    "InvoiceLine",
    "InvoiceStatus",
    "Page",
    "SpendAlert",
    "SpendLimit",
    "UsageGroupBy",
    "ChatMessageParam",
    "Completion",
    "CompletionChunk",
    "FinishReason",
    "Model",
    "PhaseUsage",
    "Priority",
    "Usage",
]

Priority = Literal["interactive", "batch"]
""""interactive" (the default) goes first when workers are busy; "batch" waits for spare capacity."""

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
    """A finished generation; `id` is the gateway's request id."""

    id: str
    model: str
    text: str
    token_ids: list[int]
    finish_reason: FinishReason
    usage: Usage


@dataclass(frozen=True, slots=True)
class CompletionChunk:
    """One streamed delta; `id` is the request id, `finish_reason` and `usage` are set on the last chunk only."""

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


# Admin API (REST, served by the control plane). Money is in micro-dollars (1 USD = 1_000_000)
# except invoice totals, which are in cents as invoiced.

T = TypeVar("T")

UsageGroupBy = Literal["phase", "model", "api_key"]
InvoiceStatus = Literal["draft", "open", "paid", "void", "uncollectible"]


@dataclass(frozen=True, slots=True)
class Page(Generic[T]):
    """One page of a list: `data`, whether more follows (`has_more`) and the `total` count."""

    data: list[T]
    has_more: bool
    total: int


@dataclass(frozen=True, slots=True)
class ApiKey:
    """An API key. `key`, the secret itself, is set only on the object `api_keys.create()` returns."""

    id: str
    name: str
    prefix: str
    scopes: list[str]
    created_at: datetime
    last_used_at: datetime | None
    expires_at: datetime | None
    revoked_at: datetime | None
    key: str | None = None


@dataclass(frozen=True, slots=True)
class DailyUsage:
    """Tokens and their price for one day and one group: a phase ("prefill", "cached_prefill",
    "decode"), a model name or an API key id, as asked by `group_by`."""

    day: date
    key: str
    tokens: int
    amount_micros: int


@dataclass(frozen=True, slots=True)
class SpendAlert:
    threshold_percent: int
    triggered_at: datetime


@dataclass(frozen=True, slots=True)
class BillingSummary:
    """The current billing period: spend to date, its projection to the period's end, the limit."""

    period_start: date
    period_end: date
    currency: str
    amount_to_date_micros: int
    projected_micros: int
    spend_limit_micros: int | None
    alerts: list[SpendAlert]


@dataclass(frozen=True, slots=True)
class SpendLimit:
    limit_micros: int | None


@dataclass(frozen=True, slots=True)
class InvoiceLine:
    model: str
    phase: str
    tokens: int
    unit_price_micros_per_million: int
    amount_micros: int


@dataclass(frozen=True, slots=True)
class Invoice:
    id: str
    period_start: date
    period_end: date
    status: InvoiceStatus
    currency: str
    total_cents: int
    lines: list[InvoiceLine]
    stripe_invoice_id: str | None
