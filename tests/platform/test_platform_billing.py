"""Ledger → rollups → rated usage → invoices: exact integer money, effective-dated prices, late events, idempotency."""

from datetime import UTC, datetime, timedelta
from io import StringIO

import pytest
from django.core import mail
from django.core.management import CommandError, call_command
from django.utils import timezone

from controlplane.billing.models import BillingPeriod, DailyUsage, HourlyUsage, Invoice, SpendAlert
from controlplane.billing.periods import period_start_of
from controlplane.billing.rating import allocate_cents, amount_micros, micros_to_cents
from controlplane.billing.services import billing_periods_close, usage_rollup
from controlplane.billing.tasks import close_billing_periods, roll_up_usage, sync_invoices_with_stripe
from controlplane.catalog.models import Price
from controlplane.catalog.services import price_set
from controlplane.celery import app as celery_app
from controlplane.metering.models import UsageEvent
from controlplane.tenancy.services import member_add

INGEST_URL = "/api/v1/internal/usage-events"
VERIFY_URL = "/api/v1/internal/api-keys/verify"
LONG_AGO = datetime(2020, 1, 1, tzinfo=UTC)
TINY_PRICES = {"prefill": 100_000, "cached_prefill": 25_000, "decode": 400_000}


def last_month_at(day: int, hour: int = 12) -> datetime:
    this_month = period_start_of(timezone.now())
    previous = (datetime(this_month.year, this_month.month, 1, tzinfo=UTC) - timedelta(days=1)).date()
    return datetime(previous.year, previous.month, day, hour, tzinfo=UTC)


@pytest.fixture
def tiny_prices(tiny_model):
    return {
        phase: price_set(model=tiny_model, phase=phase, micros_per_million=micros, effective_from=LONG_AGO)
        for phase, micros in TINY_PRICES.items()
    }


def ingest(internal_client, make_usage_event, key, request_id, phase, started_at, **fields):
    event = make_usage_event(
        key,
        request_id,
        phase,
        started_at=started_at.isoformat(),
        finished_at=(started_at + timedelta(seconds=1)).isoformat(),
        **fields,
    )
    response = internal_client.post(INGEST_URL, {"events": [event]})
    assert response.status_code == 200, response.data
    return response.data


def ingest_decode(internal_client, make_usage_event, key, request_id, started_at, tokens):
    return ingest(
        internal_client, make_usage_event, key, request_id, "decode", started_at, tokens=tokens, cached_tokens=0
    )


def sample_month(internal_client, make_usage_event, key):
    """1 234 567 prompt tokens (234 567 from the prefix cache) and 345 678 output tokens, last month."""
    ingest(
        internal_client,
        make_usage_event,
        key,
        "req-1",
        "prefill",
        last_month_at(3),
        tokens=1_000_000,
        cached_tokens=200_000,
    )
    ingest(internal_client, make_usage_event, key, "req-1", "decode", last_month_at(3), tokens=300_000, cached_tokens=0)
    ingest(
        internal_client,
        make_usage_event,
        key,
        "req-2",
        "prefill",
        last_month_at(17, 23),
        tokens=234_567,
        cached_tokens=34_567,
    )
    ingest(
        internal_client, make_usage_event, key, "req-2", "decode", last_month_at(17, 23), tokens=45_678, cached_tokens=0
    )


def test_rounding_rule_is_half_up_on_integers():
    assert amount_micros(tokens=1, unit_price_micros_per_million=499_999) == 0
    assert amount_micros(tokens=1, unit_price_micros_per_million=500_000) == 1
    assert amount_micros(tokens=234_567, unit_price_micros_per_million=25_000) == 5864  # 5864.175
    assert micros_to_cents(5_000) == 1 and micros_to_cents(4_999) == 0
    assert allocate_cents([5_000, 5_000, 5_000]) == [1, 1, 0]  # 1.5 cents → 2 cents in all
    assert sum(allocate_cents([123_456, 7_890, 99_999])) == micros_to_cents(123_456 + 7_890 + 99_999)


def test_closing_a_month_makes_an_exact_invoice_with_a_line_per_model_and_phase(
    internal_client, make_usage_event, key_a, org_a, client_a, tiny_prices
):
    sample_month(internal_client, make_usage_event, key_a)
    invoices = billing_periods_close()
    assert len(invoices) == 1
    invoice = client_a.get(f"/api/v1/invoices/{invoices[0].public_id}").data
    assert invoice["status"] == "draft"
    assert invoice["lines"] == [
        {
            "model": "diptych-tiny",
            "phase": "cached_prefill",
            "tier": "standard",
            "tokens": 234_567,
            "unit_price_micros_per_million": 25_000,
            "amount_micros": 5_864,
        },
        {
            "model": "diptych-tiny",
            "phase": "decode",
            "tier": "standard",
            "tokens": 345_678,
            "unit_price_micros_per_million": 400_000,
            "amount_micros": 138_271,
        },
        {
            "model": "diptych-tiny",
            "phase": "prefill",
            "tier": "standard",
            "tokens": 1_000_000,
            "unit_price_micros_per_million": 100_000,
            "amount_micros": 100_000,
        },
    ]
    assert invoice["total_micros"] == 244_135
    assert invoice["total_cents"] == 24
    assert invoice["period_start"] == last_month_at(1).date().isoformat()
    assert client_a.get("/api/v1/invoices").data["total"] == 1


def test_closing_again_changes_nothing(internal_client, make_usage_event, key_a, tiny_prices):
    sample_month(internal_client, make_usage_event, key_a)
    first = billing_periods_close()
    snapshot = list(Invoice.objects.values("public_id", "total_micros", "status"))
    assert billing_periods_close() == []
    assert list(Invoice.objects.values("public_id", "total_micros", "status")) == snapshot
    assert first[0].lines.count() == 3


def _rollup_rows():
    fields = [
        "organization_id",
        "api_key_id",
        "model",
        "phase",
        "period_start",
        "unit_price_micros_per_million",
        "tokens",
    ]
    hourly = sorted(HourlyUsage.objects.values_list("hour", *fields))
    daily = sorted(DailyUsage.objects.values_list("day", *fields))
    return hourly, daily


def test_rollup_is_idempotent_and_groups_by_hour_and_day(internal_client, make_usage_event, key_a, tiny_prices):
    sample_month(internal_client, make_usage_event, key_a)
    assert usage_rollup().hours == 2
    first = _rollup_rows()
    assert usage_rollup(full=True).hours == 2
    assert usage_rollup().hours == 2  # within the overlap window the same hours are rebuilt
    assert _rollup_rows() == first
    hourly, daily = first
    assert len(hourly) == 6 and len(daily) == 6  # 2 hours × 3 billed phases, on 2 days
    assert sum(row[-1] for row in daily) == 1_234_567 + 345_678


def test_usage_daily_groups_by_phase_model_and_key(internal_client, make_usage_event, key_a, client_a, tiny_prices):
    sample_month(internal_client, make_usage_event, key_a)
    usage_rollup()
    day3, day17 = last_month_at(3).date().isoformat(), last_month_at(17).date().isoformat()
    query = {"start": last_month_at(1).date().isoformat(), "end": last_month_at(28).date().isoformat()}
    by_phase = client_a.get("/api/v1/usage/daily", {**query, "group_by": "phase"})
    assert by_phase.status_code == 200
    assert by_phase.data["data"] == [
        {"day": day3, "key": "cached_prefill", "tokens": 200_000, "amount_micros": 5_000},
        {"day": day3, "key": "decode", "tokens": 300_000, "amount_micros": 120_000},
        {"day": day3, "key": "prefill", "tokens": 800_000, "amount_micros": 80_000},
        {"day": day17, "key": "cached_prefill", "tokens": 34_567, "amount_micros": 864},
        {"day": day17, "key": "decode", "tokens": 45_678, "amount_micros": 18_271},
        {"day": day17, "key": "prefill", "tokens": 200_000, "amount_micros": 20_000},
    ]
    by_model = client_a.get("/api/v1/usage/daily", {**query, "group_by": "model"}).data["data"]
    assert by_model == [
        {"day": day3, "key": "diptych-tiny", "tokens": 1_300_000, "amount_micros": 205_000},
        {"day": day17, "key": "diptych-tiny", "tokens": 280_245, "amount_micros": 39_135},
    ]
    by_key = client_a.get("/api/v1/usage/daily", {**query, "group_by": "api_key"}).data["data"]
    assert {row["key"] for row in by_key} == {key_a.api_key.public_id}


@pytest.mark.parametrize(
    ("query", "field"),
    [
        ({"start": "2026-01-02", "end": "2026-01-01"}, "end"),
        ({"start": "2026-01-01"}, "end"),
        ({"start": "yesterday", "end": "2026-01-01"}, "start"),
        ({"start": "2020-01-01", "end": "2026-01-01"}, "end"),
        ({"start": "2026-01-01", "end": "2026-01-02", "group_by": "region"}, "group_by"),
    ],
)
def test_usage_daily_rejects_bad_queries(client_a, query, field):
    response = client_a.get("/api/v1/usage/daily", query)
    assert response.status_code == 400
    assert response.data["error"]["type"] == "validation_error"
    assert field in response.data["error"]["fields"]


def test_usage_is_rated_at_the_price_in_effect_when_it_happened(
    internal_client, make_usage_event, key_a, tiny_model, tiny_prices
):
    # The price book as it stood: decode went from 400 000 to 500 000 µ$/M on the 10th of last month.
    Price.objects.create(
        model=tiny_model, phase="decode", micros_per_million=500_000, effective_from=last_month_at(10, 0)
    )
    ingest_decode(internal_client, make_usage_event, key_a, "before", last_month_at(9, 23), 1_000)
    ingest_decode(internal_client, make_usage_event, key_a, "after", last_month_at(10, 0), 1_000)
    (invoice,) = billing_periods_close()
    assert [(line.unit_price_micros_per_million, line.tokens, line.amount_micros) for line in invoice.lines.all()] == [
        (400_000, 1_000, 400),
        (500_000, 1_000, 500),
    ]


def test_a_new_price_cannot_rewrite_the_past(tiny_model, tiny_prices):
    with pytest.raises(Exception) as refused:
        yesterday = timezone.now() - timedelta(days=1)
        price_set(model=tiny_model, phase="decode", micros_per_million=1, effective_from=yesterday)
    assert "cannot start in the past" in str(refused.value)
    assert Price.objects.filter(phase="decode").count() == 1


def test_late_event_for_a_closed_period_is_billed_in_the_open_period(
    internal_client, make_usage_event, key_a, org_a, client_a, tiny_prices
):
    sample_month(internal_client, make_usage_event, key_a)
    (invoice,) = billing_periods_close()
    ingest_decode(internal_client, make_usage_event, key_a, "late", last_month_at(20), 10_000)
    late = UsageEvent.objects.get(request_id="late")
    assert late.period_start == period_start_of(timezone.now())
    assert billing_periods_close() == []
    invoice.refresh_from_db()
    assert invoice.total_micros == 244_135
    usage_rollup()
    current = client_a.get("/api/v1/billing/current").data
    assert current["amount_to_date_micros"] == 4_000
    daily = client_a.get("/api/v1/usage/daily", {"start": late.started_at.date(), "end": late.started_at.date()})
    day = late.started_at.date().isoformat()
    assert daily.data["data"] == [{"day": day, "key": "decode", "tokens": 10_000, "amount_micros": 4_000}]


def test_event_for_an_open_past_period_stays_in_its_period(internal_client, make_usage_event, key_a, tiny_prices):
    ingest_decode(internal_client, make_usage_event, key_a, "old", last_month_at(5), 1)
    assert UsageEvent.objects.get(request_id="old").period_start == last_month_at(1).date()


def test_billing_current_and_spend_limit_alerts_fire_once(
    mid_period_clock, internal_client, make_usage_event, key_a, org_a, client_a, tiny_prices
):
    """Usage of a minute or two ago counts in the open period: the clock is pinned mid-period, as a minute ago
    is last month in the first minutes of a month."""
    member_add(organization=org_a, email="owner@acme.test", role="owner", password="a-long-owner-password")
    assert client_a.put("/api/v1/spend-limit", {"limit_micros": 1_000}, format="json").data == {"limit_micros": 1_000}
    now = timezone.now()
    ingest_decode(internal_client, make_usage_event, key_a, "r1", now - timedelta(minutes=2), 2_000)
    usage_rollup()  # 800 µ$ of 1 000: the 80% alert
    assert list(SpendAlert.objects.values_list("threshold_percent", flat=True)) == [80]
    assert len(mail.outbox) == 1 and mail.outbox[0].to == ["owner@acme.test"]
    spend = internal_client.post(VERIFY_URL, {"api_key": key_a.key}).data["spend"]
    assert spend == {"limit_micros": 1_000, "spent_micros": 800, "over_limit": False}

    ingest_decode(internal_client, make_usage_event, key_a, "r2", now - timedelta(minutes=1), 500)
    usage_rollup()
    usage_rollup()
    assert sorted(SpendAlert.objects.values_list("threshold_percent", flat=True)) == [80, 100]
    assert len(mail.outbox) == 2
    spend = internal_client.post(VERIFY_URL, {"api_key": key_a.key}).data["spend"]
    assert spend == {"limit_micros": 1_000, "spent_micros": 1_000, "over_limit": True}

    current = client_a.get("/api/v1/billing/current").data
    assert current["amount_to_date_micros"] == 1_000
    assert current["spend_limit_micros"] == 1_000
    assert current["currency"] == "usd"
    assert current["projected_micros"] >= 1_000
    assert [alert["threshold_percent"] for alert in current["alerts"]] == [80, 100]
    assert BillingPeriod.objects.get(organization=org_a, start=period_start_of(now)).amount_to_date_micros == 1_000


@pytest.mark.parametrize(
    "body",
    [
        {"limit_micros": -1},
        {"limit_micros": "lots"},
        {},
        {"limit_micros": 1.5},
        # As strict as PATCH /limits: a count is a JSON integer, and an unknown field is named, not ignored.
        {"limit_micros": "1"},
        {"limit_micros": 1.0},
        {"limit_micros": " 7 "},
        {"limit_micros": True},
        {"limit_micros": 7, "limit": 7},
    ],
)
def test_spend_limit_rejects_bad_values_and_keeps_the_old_one(client_a, org_a, body):
    client_a.put("/api/v1/spend-limit", {"limit_micros": 5}, format="json")
    response = client_a.put("/api/v1/spend-limit", body, format="json")
    assert response.status_code == 400
    assert response.data["error"]["fields"]
    assert client_a.get("/api/v1/spend-limit").data == {"limit_micros": 5}


def test_removing_the_spend_limit(client_a, org_a):
    client_a.put("/api/v1/spend-limit", {"limit_micros": 5}, format="json")
    assert client_a.put("/api/v1/spend-limit", {"limit_micros": None}, format="json").data == {"limit_micros": None}
    org_a.refresh_from_db()
    assert org_a.spend_limit_micros is None


def test_invoice_preview_prints_the_worked_invoice(internal_client, make_usage_event, key_a, org_a, tiny_prices):
    sample_month(internal_client, make_usage_event, key_a)
    stdout = StringIO()
    period = f"{last_month_at(1):%Y-%m}"
    call_command("invoice_preview", "--organization", org_a.public_id, "--period", period, stdout=stdout)
    printed = stdout.getvalue()
    print(printed)
    assert "diptych-tiny     cached_prefill        234,567 ×        $0.025000 =       $0.005864       0" in printed
    assert "diptych-tiny     decode                345,678 ×        $0.400000 =       $0.138271      14" in printed
    assert "diptych-tiny     prefill             1,000,000 ×        $0.100000 =       $0.100000      10" in printed
    assert "$0.244135" in printed and "amount due: 24 cents (USD 0.24)" in printed
    assert not Invoice.objects.exists()  # a preview writes nothing


@pytest.mark.parametrize(("organization", "period"), [("org_missing", "2026-10"), (None, "October")])
def test_invoice_preview_rejects_bad_arguments(org_a, organization, period):
    with pytest.raises(CommandError):
        call_command("invoice_preview", "--organization", organization or org_a.public_id, "--period", period)


@pytest.mark.parametrize(
    "task_name",
    [
        "controlplane.billing.tasks.roll_up_usage",
        "controlplane.billing.tasks.close_billing_periods",
        "controlplane.billing.tasks.sync_invoices_with_stripe",
    ],
)
def test_billing_jobs_are_registered_and_scheduled(task_name):
    celery_app.loader.import_default_modules()
    assert task_name in celery_app.tasks
    assert task_name in {entry["task"] for entry in celery_app.conf.beat_schedule.values()}


def test_billing_jobs_run_as_tasks(internal_client, make_usage_event, key_a, tiny_prices, settings):
    settings.STRIPE_API_KEY = ""
    sample_month(internal_client, make_usage_event, key_a)
    assert roll_up_usage.apply().get() == 2
    assert close_billing_periods.apply().get() == 1
    assert sync_invoices_with_stripe.apply().get() == 0  # no Stripe configured: the invoice stays a draft
    assert Invoice.objects.get().status == "draft"


def test_lowering_the_limit_below_the_spend_alerts_at_once(
    mid_period_clock, internal_client, make_usage_event, key_a, org_a, client_a, tiny_prices
):
    ingest_decode(internal_client, make_usage_event, key_a, "r", timezone.now() - timedelta(minutes=1), 2_500)
    usage_rollup()  # 1 000 µ$ spent, no limit yet: no alert
    assert not SpendAlert.objects.exists()
    assert client_a.put("/api/v1/spend-limit", {"limit_micros": 900}, format="json").status_code == 200
    assert sorted(SpendAlert.objects.values_list("threshold_percent", flat=True)) == [80, 100]
    spend = internal_client.post(VERIFY_URL, {"api_key": key_a.key}).data["spend"]
    assert spend == {"limit_micros": 900, "spent_micros": 1_000, "over_limit": True}
