"""Ingest batches racing each other and the period close: no usage event is lost, counted twice, or slipped
into an invoice after it was made. Needs concurrent writers, so it runs on PostgreSQL (CI's database)."""

import random
import threading
from datetime import UTC, datetime, timedelta

import pytest
from django.db import connection
from rest_framework.test import APIClient

from controlplane.billing.models import DailyUsage, HourlyUsage, Invoice
from controlplane.billing.periods import period_start_of
from controlplane.billing.rating import amount_micros
from controlplane.billing.selectors import spend_status
from controlplane.billing.services import billing_periods_close, invoice_lines_from_ledger, usage_rollup
from controlplane.catalog.selectors import price_book
from controlplane.catalog.services import price_set
from controlplane.metering.models import UsageEvent

INGEST_URL = "/api/v1/internal/usage-events"
INGESTERS = 3
REQUESTS = 30
BATCH = 5
LONG_AGO = datetime(2020, 1, 1, tzinfo=UTC)


def _ingest(
    internal_token: str, batches: list[list[dict]], seed: int, start: threading.Barrier, results: list, errors: list
) -> None:
    """Posts every batch of events, in an order of its own, once all the racers are ready."""
    try:
        client = APIClient()
        client.credentials(HTTP_AUTHORIZATION=f"Bearer {internal_token}")
        order = batches[:]
        random.Random(seed).shuffle(order)
        start.wait()
        for batch in order:
            response = client.post(INGEST_URL, {"events": batch}, format="json")
            assert response.status_code == 200, response.content
            results.append(response.json())
    except Exception as error:  # reported by the test, with the thread's failure
        errors.append(error)
    finally:
        connection.close()


def _close_until(ingests_done: threading.Event, start: threading.Barrier, errors: list) -> None:
    """Keeps trying until the period exists and is closed, so the close lands in the middle of the ingests."""
    try:
        start.wait()
        while not ingests_done.is_set() and not billing_periods_close():
            pass
    except Exception as error:
        errors.append(error)
    finally:
        connection.close()


@pytest.mark.django_db(transaction=True)
def test_racing_ingests_and_close_keep_the_ledger_and_invoice_exact(
    org_a, key_a, tiny_model, internal_token, make_usage_event
):
    if connection.vendor != "postgresql":
        pytest.skip("concurrent writers need PostgreSQL; SQLite serialises them")
    for phase, micros in (("prefill", 100_000), ("cached_prefill", 25_000), ("decode", 400_000)):
        price_set(model=tiny_model, phase=phase, micros_per_million=micros, effective_from=LONG_AGO)
    this_month = period_start_of(datetime.now(UTC))
    started = datetime(this_month.year, this_month.month, 1, tzinfo=UTC) - timedelta(days=3)
    events = [
        make_usage_event(
            key_a,
            f"race-{index}",
            phase,
            tokens=100 + index,
            cached_tokens=index if phase == "prefill" else 0,
            started_at=started.isoformat(),
            finished_at=(started + timedelta(seconds=1)).isoformat(),
        )
        for index in range(REQUESTS)
        for phase in ("prefill", "decode")
    ]
    batches = [events[i : i + BATCH] for i in range(0, len(events), BATCH)]
    start = threading.Barrier(INGESTERS + 1)
    ingests_done = threading.Event()
    results, errors = [], []
    threads = [
        threading.Thread(target=_ingest, args=(internal_token, batches, seed, start, results, errors))
        for seed in range(INGESTERS)
    ]
    threads.append(threading.Thread(target=_close_until, args=(ingests_done, start, errors)))
    for thread in threads:
        thread.start()
    for thread in threads[:INGESTERS]:
        thread.join(timeout=120)
    ingests_done.set()
    threads[-1].join(timeout=120)
    assert not errors, errors
    assert not any(thread.is_alive() for thread in threads)

    assert UsageEvent.objects.filter(request_id__startswith="race-").count() == len(events)
    assert sum(result["accepted"] for result in results) == len(events)
    assert sum(result["duplicates"] for result in results) == (INGESTERS - 1) * len(events)

    billing_periods_close()  # closes the period now if the racing close found it still empty
    invoice = Invoice.objects.get(organization=org_a)
    billed_now = invoice_lines_from_ledger(organization=org_a, period_start=invoice.period_start, book=price_book())
    assert [(line.phase, line.tokens) for line in billed_now] == [
        (line.phase, line.tokens) for line in invoice.lines.order_by("model", "phase", "unit_price_micros_per_million")
    ]
    late = UsageEvent.objects.filter(request_id__startswith="race-", period_start=this_month)
    in_invoice = sum(line.tokens for line in invoice.lines.all())
    late_tokens = sum(event.tokens for event in late)  # billed in the open period, as late events are
    assert in_invoice + late_tokens == sum(event["tokens"] for event in events)


@pytest.mark.django_db(transaction=True)
def test_rollups_running_at_once_do_not_double_count(org_a, key_a, tiny_model, internal_client, make_usage_event):
    if connection.vendor != "postgresql":
        pytest.skip("concurrent writers need PostgreSQL; SQLite serialises them")
    price_set(model=tiny_model, phase="decode", micros_per_million=400_000, effective_from=LONG_AGO)
    started = datetime.now(UTC) - timedelta(hours=30)
    events = [
        make_usage_event(
            key_a,
            f"roll-{index}",
            "decode",
            tokens=1_000,
            cached_tokens=0,
            started_at=(started + timedelta(hours=index)).isoformat(),
            finished_at=(started + timedelta(hours=index, seconds=1)).isoformat(),
        )
        for index in range(24)
    ]
    assert internal_client.post(INGEST_URL, {"events": events}, format="json").status_code == 200
    runners = 4
    start = threading.Barrier(runners)
    errors = []

    def roll_up() -> None:
        try:
            start.wait()
            usage_rollup(full=True)
        except Exception as error:  # reported below
            errors.append(error)
        finally:
            connection.close()

    threads = [threading.Thread(target=roll_up) for _ in range(runners)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=120)
    assert not errors, errors
    assert HourlyUsage.objects.count() == 24
    assert sum(DailyUsage.objects.values_list("tokens", flat=True)) == 24_000
    this_month = period_start_of(datetime.now(UTC))
    in_this_month = [e for e in events if period_start_of(datetime.fromisoformat(e["started_at"])) == this_month]
    expected = amount_micros(tokens=1_000 * len(in_this_month), unit_price_micros_per_million=400_000)
    assert spend_status(organization=org_a)["spent_micros"] == expected
