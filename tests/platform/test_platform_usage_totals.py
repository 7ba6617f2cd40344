"""GET /api/v1/usage/daily's totals: the spend of a range rounded once, by the invoice's rule (each line rounded,
then added), and spread over the keys, projects or models so that they add up to it; over a range that holds the
open period's usage it is exactly billing/current/costs' total, which daily rows rounded one by one are not."""

import pytest
from django.utils import timezone

from controlplane.billing.rating import apportion
from controlplane.billing.services import usage_rollup
from controlplane.catalog.services import price_set
from controlplane.tenancy.models import Scope
from controlplane.tenancy.services import api_key_create
from tests.platform.test_platform_billing import LONG_AGO, TINY_PRICES, ingest
from tests.platform.test_platform_period_costs import BATCH_DECODE_PRICE, COSTS_URL, this_period_moments

pytestmark = pytest.mark.usefixtures("mid_period_clock")


@pytest.fixture
def prices(tiny_model) -> None:
    for phase, micros in TINY_PRICES.items():
        price_set(model=tiny_model, phase=phase, micros_per_million=micros, effective_from=LONG_AGO)
    price_set(
        model=tiny_model, phase="decode", tier="batch", micros_per_million=BATCH_DECODE_PRICE, effective_from=LONG_AGO
    )


def ingest_half_micros(internal_client, make_usage_event, key_a, key_b) -> None:
    """Amounts that are halves or fractions of a micro-dollar on every day × key row and on every line."""
    first, now = this_period_moments()
    # 5 computed prompt tokens (0.5 µ$), 20 cached ones (0.5 µ$), 1 output token (0.4 µ$): 1.4 µ$, one row.
    ingest(internal_client, make_usage_event, key_a, "a-1", "prefill", first, tokens=25, cached_tokens=20)
    ingest(internal_client, make_usage_event, key_a, "a-1", "decode", first, tokens=1, cached_tokens=0)
    ingest(internal_client, make_usage_event, key_a, "a-2", "decode", now, tokens=1, cached_tokens=0)  # 0.4 µ$
    ingest(internal_client, make_usage_event, key_a, "a-3", "decode", now, tier="batch", tokens=3, cached_tokens=0)
    ingest(internal_client, make_usage_event, key_b, "b-1", "prefill", now, tokens=5, cached_tokens=0)  # 0.5 µ$


@pytest.fixture
def second_key(org_a):
    return api_key_create(organization=org_a, name="second", scopes=Scope.values)


def test_the_range_total_is_the_period_s_invoice_total_and_its_keys_add_up_to_it(
    internal_client, make_usage_event, key_a, second_key, client_a, prices
):
    ingest_half_micros(internal_client, make_usage_event, key_a, second_key)
    usage_rollup()
    first, _now = this_period_moments()
    days = {"start": first.date().isoformat(), "end": timezone.now().date().isoformat()}
    costs = client_a.get(COSTS_URL).data
    # Lines: prefill 10 tokens (1.0), cached 20 (0.5 -> 1), decode 2 (0.8 -> 1), batch decode 3 (0.6 -> 1).
    assert costs["total_micros"] == 4
    by_key = client_a.get("/api/v1/usage/daily", {**days, "group_by": "api_key"}).data
    assert sum(row["amount_micros"] for row in by_key["data"]) == 3  # rows rounded one by one: not the total
    for group_by in ("api_key", "project", "model", "phase", "tier"):
        answer = client_a.get("/api/v1/usage/daily", {**days, "group_by": group_by}).data
        assert answer["total_micros"] == costs["total_micros"], group_by
        assert sum(row["amount_micros"] for row in answer["totals"]) == answer["total_micros"], group_by
        assert sum(row["tokens"] for row in answer["totals"]) == sum(row["tokens"] for row in answer["data"])
    totals = {row["key"]: row for row in by_key["totals"]}
    # Exact amounts 2.4 µ$ and 0.5 µ$ share the 4 µ$: 3.31… and 0.68…, by largest remainder 3 and 1.
    assert totals[key_a.api_key.public_id]["amount_micros"] == 3
    assert totals[second_key.api_key.public_id]["amount_micros"] == 1
    assert totals[second_key.api_key.public_id]["tokens"] == 5


def test_a_kind_of_keys_or_a_project_has_its_own_total(internal_client, make_usage_event, key_a, client_a, prices):
    first, now = this_period_moments()
    ingest(internal_client, make_usage_event, key_a, "a-1", "decode", now, tokens=3, cached_tokens=0)  # 1.2 µ$
    usage_rollup()
    days = {"start": first.date().isoformat(), "end": timezone.now().date().isoformat(), "group_by": "api_key"}
    standard = client_a.get("/api/v1/usage/daily", {**days, "api_key_kind": "standard"}).data
    assert standard["total_micros"] == 1 and standard["totals"][0]["amount_micros"] == 1
    runners = client_a.get("/api/v1/usage/daily", {**days, "api_key_kind": "batch_runner"}).data
    assert runners == {"object": "list", "data": [], "totals": [], "total_micros": 0}


@pytest.mark.parametrize(
    ("total", "weights", "shares"),
    [
        (4, [24, 5], [3, 1]),
        (10, [1, 1, 1], [4, 3, 3]),
        (7, [0, 5], [0, 7]),
        (0, [3, 4], [0, 0]),
        (5, [0, 0], [0, 0]),
        (2, [], []),
    ],
)
def test_apportion_adds_up_to_the_total_in_proportion(total, weights, shares):
    assert apportion(total, weights) == shares
