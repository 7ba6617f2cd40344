"""What one request cost: its events rated as the rollup rates them (each billed part at the price in effect
when its phase started, batch usage at the batch price), rounded once for the request (rating.py's rule for a
row of a usage report)."""

from collections.abc import Sequence
from dataclasses import dataclass

from controlplane.billing.rating import billed_parts, micros_from_token_price_product
from controlplane.catalog.selectors import PriceBook
from controlplane.metering.models import UsageEvent


@dataclass(frozen=True)
class CostLine:
    phase: str  # a billed phase: prefill, cached_prefill or decode
    tokens: int
    unit_price_micros_per_million: int | None  # None: unpriced, billed nothing


@dataclass(frozen=True)
class RequestCost:
    lines: list[CostLine]
    amount_micros: int
    currency: str = "usd"


def request_cost(*, events: Sequence[UsageEvent], book: PriceBook) -> RequestCost:
    lines: list[CostLine] = []
    exact = 0  # Σ tokens × micro-dollars per million tokens
    for event in events:
        for phase, tokens in billed_parts(phase=event.phase, tokens=event.tokens, cached_tokens=event.cached_tokens):
            if not tokens:
                continue
            price = book.unit_price(model=event.model, phase=phase, at=event.started_at, tier=event.tier)
            lines.append(CostLine(phase=phase, tokens=tokens, unit_price_micros_per_million=price))
            exact += tokens * (price or 0)
    return RequestCost(lines=lines, amount_micros=micros_from_token_price_product(exact))
