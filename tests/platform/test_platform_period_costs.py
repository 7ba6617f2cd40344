"""GET /api/v1/billing/current/costs: the open period's usage rated with the price book, per phase and per day."""

from collections import defaultdict
from datetime import UTC, datetime, timedelta

import pytest
from django.utils import timezone

from controlplane.billing.periods import period_end_of, period_start_of
from controlplane.billing.services import billing_periods_close, invoice_lines_from_ledger, usage_rollup
from controlplane.catalog.selectors import price_book
from controlplane.catalog.services import price_set
from tests.platform.test_platform_billing import LONG_AGO, TINY_PRICES, ingest, last_month_at

COSTS_URL = "/api/v1/billing/current/costs"
BATCH_DECODE_PRICE = 200_000
EMPTY_PHASES = [{"phase": phase, "tokens": 0, "amount_micros": 0} for phase in ("prefill", "cached_prefill", "decode")]

# The period's first day and now must be days apart: on the 1st of a month they are one day, whose rows merge.
pytestmark = pytest.mark.usefixtures("mid_period_clock")


@pytest.fixture
def prices(tiny_model):
    for phase, micros in TINY_PRICES.items():
        price_set(model=tiny_model, phase=phase, micros_per_million=micros, effective_from=LONG_AGO)
    price_set(
        model=tiny_model, phase="decode", tier="batch", micros_per_million=BATCH_DECODE_PRICE, effective_from=LONG_AGO
    )


def this_period_moments() -> tuple[datetime, datetime]:
    """The open period's first hour and a second ago."""
    now = timezone.now() - timedelta(seconds=1)
    start = period_start_of(now)
    return datetime(start.year, start.month, start.day, tzinfo=UTC), now


def ingest_period(internal_client, make_usage_event, key, prefix: str) -> None:
    """Standard usage on the period's first day and now, and a batch request now."""
    first, now = this_period_moments()
    ingest(internal_client, make_usage_event, key, f"{prefix}-1", "prefill", first, tokens=1_000, cached_tokens=300)
    ingest(internal_client, make_usage_event, key, f"{prefix}-1", "decode", first, tokens=70, cached_tokens=0)
    ingest(internal_client, make_usage_event, key, f"{prefix}-2", "prefill", now, tokens=2_345, cached_tokens=0)
    ingest(internal_client, make_usage_event, key, f"{prefix}-2", "decode", now, tokens=333, cached_tokens=0)
    batch = {"tier": "batch", "tokens": 1_001, "cached_tokens": 0}
    ingest(internal_client, make_usage_event, key, f"{prefix}-3", "decode", now, **batch)


def test_cost_per_phase_is_the_ledger_rated_at_the_price_book(
    internal_client, make_usage_event, key_a, client_a, org_a, prices
):
    ingest_period(internal_client, make_usage_event, key_a, "req")
    usage_rollup()
    response = client_a.get(COSTS_URL)
    assert response.status_code == 200, response.data
    costs = response.data

    start = period_start_of(timezone.now())
    assert (costs["period_start"], costs["period_end"]) == (start.isoformat(), period_end_of(start).isoformat())
    assert costs["currency"] == "usd" and costs["as_of"] is not None
    ledger = invoice_lines_from_ledger(organization=org_a, period_start=start, book=price_book())
    by_phase: dict[str, list[int]] = defaultdict(lambda: [0, 0])
    for line in ledger:
        by_phase[line.phase][0] += line.tokens
        by_phase[line.phase][1] += line.amount_micros
    assert costs["phases"] == [
        {"phase": phase, "tokens": by_phase[phase][0], "amount_micros": by_phase[phase][1]}
        for phase in ("prefill", "cached_prefill", "decode")
    ]
    # The same figures worked by hand: the batch decode at the batch price, cached prompt tokens at the cached rate.
    decode = (70 + 333) * TINY_PRICES["decode"] + 1_001 * BATCH_DECODE_PRICE
    assert by_phase["decode"] == [70 + 333 + 1_001, round(decode / 1_000_000)]
    assert by_phase["cached_prefill"] == [300, round(300 * TINY_PRICES["cached_prefill"] / 1_000_000)]
    assert costs["total_micros"] == sum(amount for _, amount in by_phase.values())
    assert costs["total_micros"] == client_a.get("/api/v1/billing/current").data["amount_to_date_micros"]


def test_rows_are_per_day_model_phase_and_tier(internal_client, make_usage_event, key_a, client_a, prices):
    ingest_period(internal_client, make_usage_event, key_a, "req")
    usage_rollup()
    first, now = this_period_moments()
    expected: dict[tuple[str, str, str], list[int]] = defaultdict(lambda: [0, 0])  # tokens, exact amount
    for day, phase, tier, tokens, price in [
        (first, "prefill", "standard", 700, TINY_PRICES["prefill"]),
        (first, "cached_prefill", "standard", 300, TINY_PRICES["cached_prefill"]),
        (first, "decode", "standard", 70, TINY_PRICES["decode"]),
        (now, "prefill", "standard", 2_345, TINY_PRICES["prefill"]),
        (now, "decode", "standard", 333, TINY_PRICES["decode"]),
        (now, "decode", "batch", 1_001, BATCH_DECODE_PRICE),
    ]:
        expected[(day.date().isoformat(), phase, tier)][0] += tokens
        expected[(day.date().isoformat(), phase, tier)][1] += tokens * price
    rows = client_a.get(COSTS_URL).data["data"]
    assert rows == [
        {
            "day": day,
            "model": "diptych-tiny",
            "phase": phase,
            "tier": tier,
            "tokens": tokens,
            "amount_micros": (exact + 500_000) // 1_000_000,
        }
        for (day, phase, tier), (tokens, exact) in sorted(expected.items())
    ]


def test_another_organizations_usage_never_shows(
    internal_client, make_usage_event, key_a, key_b, client_a, client_b, prices
):
    ingest_period(internal_client, make_usage_event, key_b, "other")
    usage_rollup()
    mine = client_a.get(COSTS_URL).data
    assert (mine["phases"], mine["data"], mine["total_micros"]) == (EMPTY_PHASES, [], 0)
    theirs = client_b.get(COSTS_URL).data
    assert theirs["total_micros"] > 0 and len(theirs["data"]) == 6


def test_an_empty_period_has_every_phase_at_zero(client_a, prices):
    costs = client_a.get(COSTS_URL).data
    assert (costs["phases"], costs["data"], costs["total_micros"]) == (EMPTY_PHASES, [], 0)


def test_a_late_event_of_a_closed_period_counts_here_on_its_real_day(
    internal_client, make_usage_event, key_a, client_a, prices
):
    ingest(internal_client, make_usage_event, key_a, "req-old", "decode", last_month_at(20), tokens=10, cached_tokens=0)
    usage_rollup()
    billing_periods_close()
    ingest(internal_client, make_usage_event, key_a, "req-late", "decode", last_month_at(21), tokens=5, cached_tokens=0)
    usage_rollup()
    rows = client_a.get(COSTS_URL).data["data"]
    assert [(row["day"], row["tokens"]) for row in rows] == [(last_month_at(21).date().isoformat(), 5)]


def test_reading_costs_needs_billing_read(client_a, org_a, prices):
    from rest_framework.test import APIClient

    from controlplane.tenancy.services import member_add, user_ensure

    user = user_ensure(email="dev@acme.test", password="a-long-enough-password")
    member_add(organization=org_a, email="dev@acme.test", role="developer")
    developer = APIClient()
    developer.force_login(user)
    response = developer.get(COSTS_URL)
    assert response.status_code == 403 and "billing:read" in str(response.data)
