"""Money arithmetic of billing, in integers only.

Rounding rule: an amount is exact in fractions of a micro-dollar (tokens × micro-dollars per million
tokens / 1 000 000) and is rounded half up to whole micro-dollars once per invoice line (or per row of a
usage report); an invoice total is the sum of its rounded lines, and is rounded half up to whole cents.
Cents are spread over the lines by largest remainder, so the lines sent to Stripe add up to the total; a
report's total is spread over its keys (projects, models) the same way, so that its rows add up to it.
"""

from controlplane.catalog.models import PricePhase

TOKENS_PER_PRICE_UNIT = 1_000_000
MICROS_PER_CENT = 10_000


def _divide_half_up(numerator: int, denominator: int) -> int:
    return (numerator + denominator // 2) // denominator


def micros_from_token_price_product(product: int) -> int:
    """Σ tokens × micro-dollars per million tokens, rounded half up to whole micro-dollars."""
    return _divide_half_up(product, TOKENS_PER_PRICE_UNIT)


def amount_micros(*, tokens: int, unit_price_micros_per_million: int) -> int:
    return micros_from_token_price_product(tokens * unit_price_micros_per_million)


def micros_to_cents(micros: int) -> int:
    return _divide_half_up(micros, MICROS_PER_CENT)


def allocate_cents(line_micros: list[int]) -> list[int]:
    """Whole cents per line that add up to micros_to_cents(sum(line_micros)), by largest remainder."""
    total_cents = micros_to_cents(sum(line_micros))
    floors = [micros // MICROS_PER_CENT for micros in line_micros]
    shortfall = total_cents - sum(floors)
    by_remainder = sorted(range(len(line_micros)), key=lambda i: (-(line_micros[i] % MICROS_PER_CENT), i))
    for index in by_remainder[:shortfall]:
        floors[index] += 1
    return floors


def apportion(total_micros: int, weights: list[int]) -> list[int]:
    """Whole micro-dollars per weight, in proportion to it, that add up to `total_micros`, by largest remainder:
    the shares of an amount rounded once (an invoice's lines) among the keys, projects or models it covers."""
    weight = sum(weights)
    if weight == 0:
        return [0 for _ in weights]
    floors = [total_micros * part // weight for part in weights]
    shortfall = total_micros - sum(floors)
    by_remainder = sorted(range(len(weights)), key=lambda i: (-(total_micros * weights[i] % weight), i))
    for index in by_remainder[:shortfall]:
        floors[index] += 1
    return floors


def billed_parts(*, phase: str, tokens: int, cached_tokens: int) -> list[tuple[str, int]]:
    """How a usage event's tokens are billed: prefill splits into computed and prefix-cache-hit tokens."""
    if phase == "prefill":
        return [(PricePhase.PREFILL, tokens - cached_tokens), (PricePhase.CACHED_PREFILL, cached_tokens)]
    return [(PricePhase.DECODE, tokens)]
