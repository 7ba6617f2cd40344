import logging
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import UTC, date, datetime, timedelta

from django.conf import settings
from django.core.mail import send_mail
from django.db import IntegrityError, transaction
from django.db.models.functions import TruncHour
from django.utils import timezone

from controlplane.billing.models import (
    ROLLUP_CURSOR,
    BillingAccount,
    BillingPeriod,
    DailyUsage,
    HourlyUsage,
    Invoice,
    InvoiceLine,
    InvoiceStatus,
    PeriodStatus,
    ProcessedStripeEvent,
    RollupCursor,
    SpendAlert,
)
from controlplane.billing.periods import billing_periods_assign, period_start_of
from controlplane.billing.rating import allocate_cents, billed_parts, micros_to_cents
from controlplane.billing.selectors import RatedLine, billing_period_current, period_lines_to_date, rated_lines
from controlplane.billing.stripe_gateway import STRIPE_INVOICE_STATUSES, StripeGateway
from controlplane.catalog.models import PriceTier
from controlplane.catalog.selectors import PriceBook, price_book
from controlplane.common.errors import InvalidInput
from controlplane.metering.models import UsageEvent
from controlplane.metering.services import IngestResult, usage_batch_new, usage_events_store
from controlplane.tenancy.access import SYSTEM, Principal
from controlplane.tenancy.models import Organization
from controlplane.tenancy.selectors import owner_emails
from controlplane.tenancy.services import audit_record
from diptych_common.internal_api import messages

logger = logging.getLogger(__name__)

# Events are stamped with ingested_at before their transaction commits; re-reading this far back
# catches those that committed after a rollup had read past their stamp.
ROLLUP_OVERLAP = timedelta(minutes=5)
SPEND_ALERT_THRESHOLDS = (80, 100)
EPOCH = datetime(1970, 1, 1, tzinfo=UTC)

RollupKey = tuple[int, int, str, str, str, date, int | None]  # organization, api key, model, phase, tier, period, price


@transaction.atomic
def usage_events_ingest(*, reports: Sequence[messages.UsageEvent]) -> IngestResult:
    """Store a batch of usage events, all or nothing, each new one in the billing period it is billed in
    (billing.periods); a (request_id, phase) seen before is a duplicate."""
    new = usage_batch_new(reports=reports)
    ingested_at = timezone.now()
    wanted = [
        (api_key.organization_id, period_start_of(datetime.fromisoformat(report.started_at)))
        for report, api_key in new.events
    ]
    billed_in = billing_periods_assign(wanted=wanted, now=ingested_at)
    return usage_events_store(new=new, period_starts=[billed_in[key] for key in wanted], ingested_at=ingested_at)


@dataclass(frozen=True)
class RollupResult:
    hours: int
    periods: int


def _rate_events(events, book: PriceBook) -> dict[RollupKey, int]:
    """Tokens per (organization, api key, model, billed phase, tier, period, unit price at the event's start)."""
    tokens: dict[RollupKey, int] = defaultdict(int)
    for event in events:
        for phase, count in billed_parts(phase=event.phase, tokens=event.tokens, cached_tokens=event.cached_tokens):
            if not count:
                continue
            price = book.unit_price(model=event.model, phase=phase, at=event.started_at, tier=event.tier)
            key = (event.organization_id, event.api_key_id, event.model, phase, event.tier, event.period_start, price)
            tokens[key] += count
    return tokens


RATED_FIELDS = [
    "organization_id",
    "api_key_id",
    "model",
    "phase",
    "tier",
    "tokens",
    "cached_tokens",
    "period_start",
    "started_at",
]


def _events_between(start: datetime, end: datetime):
    events = UsageEvent.objects.filter(started_at__gte=start, started_at__lt=end)
    return events.only(*RATED_FIELDS).iterator(chunk_size=2000)


def _rebuild_hour(hour: datetime, book: PriceBook) -> set[tuple[int, date]]:
    HourlyUsage.objects.filter(hour=hour).delete()
    rated = _rate_events(_events_between(hour, hour + timedelta(hours=1)), book)
    HourlyUsage.objects.bulk_create(
        HourlyUsage(**_rollup_fields(key), tokens=tokens, hour=hour) for key, tokens in rated.items()
    )
    return {(key[0], key[5]) for key in rated}  # (organization, period)


def _rebuild_day(day: date) -> None:
    start = datetime(day.year, day.month, day.day, tzinfo=UTC)
    DailyUsage.objects.filter(day=day).delete()
    tokens: dict[RollupKey, int] = defaultdict(int)
    for row in HourlyUsage.objects.filter(hour__gte=start, hour__lt=start + timedelta(days=1)).iterator():
        price = row.unit_price_micros_per_million
        key = (row.organization_id, row.api_key_id, row.model, row.phase, row.tier, row.period_start, price)
        tokens[key] += row.tokens
    DailyUsage.objects.bulk_create(
        DailyUsage(**_rollup_fields(key), tokens=count, day=day) for key, count in tokens.items()
    )


def _rollup_fields(key: RollupKey) -> dict:
    """The fields an hourly or daily rollup row takes from its key."""
    organization_id, api_key_id, model, phase, tier, period, price = key
    return {
        "organization_id": organization_id,
        "api_key_id": api_key_id,
        "model": model,
        "phase": phase,
        "tier": tier,
        "period_start": period,
        "unit_price_micros_per_million": price,
    }


def usage_rollup(*, now: datetime | None = None, full: bool = False) -> RollupResult:
    """Rebuild the hourly and daily rollups of every hour that received events since the last run.

    Each touched hour is recomputed from the ledger, so running this twice changes nothing; the cursor
    row is locked for the whole rebuild, so two runs never interleave.
    """
    now = now or timezone.now()
    touched_periods: set[tuple[int, date]] = set()
    with transaction.atomic():
        RollupCursor.objects.get_or_create(name=ROLLUP_CURSOR, defaults={"ingested_before": EPOCH})
        cursor = RollupCursor.objects.select_for_update().get(name=ROLLUP_CURSOR)
        events = UsageEvent.objects.all()
        if not full:
            events = events.filter(ingested_at__gte=cursor.ingested_before - ROLLUP_OVERLAP)
        hours = sorted(set(events.annotate(hour=TruncHour("started_at")).values_list("hour", flat=True).distinct()))
        book = price_book()
        for hour in hours:
            touched_periods |= _rebuild_hour(hour, book)
        for day in sorted({hour.date() for hour in hours}):
            _rebuild_day(day)
        cursor.ingested_before = now
        cursor.save(update_fields=["ingested_before"])
    for organization_id, start in sorted(touched_periods):
        billing_period_refresh(organization=Organization.objects.get(pk=organization_id), start=start, now=now)
    return RollupResult(hours=len(hours), periods=len(touched_periods))


def billing_period_refresh(*, organization: Organization, start: date, now: datetime | None = None) -> BillingPeriod:
    """Store the period's amount to date (from the daily rollup) and raise spend alerts it crossed."""
    amount = sum(line.amount_micros for line in period_lines_to_date(organization=organization, period_start=start))
    BillingPeriod.objects.filter(organization=organization, start=start, status=PeriodStatus.OPEN).update(
        amount_to_date_micros=amount
    )
    period = BillingPeriod.objects.get(organization=organization, start=start)
    if start == period_start_of(now or timezone.now()):
        spend_alerts_check(organization=organization, period=period)
    return period


@transaction.atomic
def spend_limit_set(*, organization: Organization, limit_micros: int | None, actor: Principal = SYSTEM) -> Organization:
    """Set (or with None remove) the spend cap; a cap already crossed this period alerts at once."""
    previous = organization.spend_limit_micros
    organization.spend_limit_micros = limit_micros
    organization.save(update_fields=["spend_limit_micros"])
    audit_record(
        actor=actor,
        organization=organization,
        action="spend_limit.set",
        target_type="organization",
        target_id=organization.public_id,
        details={"from": previous, "to": limit_micros},
    )
    period = billing_period_current(organization=organization)
    if period is not None:
        spend_alerts_check(organization=organization, period=period)
    return organization


def spend_alerts_check(*, organization: Organization, period: BillingPeriod) -> list[SpendAlert]:
    """Record (and email the owners) each threshold of the spend limit first crossed in this period."""
    limit = organization.spend_limit_micros
    spent = period.amount_to_date_micros
    fired: list[SpendAlert] = []
    if limit is None or spent == 0:
        return fired
    for threshold in SPEND_ALERT_THRESHOLDS:
        if spent * 100 < limit * threshold:
            continue
        try:
            with transaction.atomic():
                alert = SpendAlert.objects.create(
                    organization=organization,
                    period_start=period.start,
                    threshold_percent=threshold,
                    spent_micros=spent,
                    limit_micros=limit,
                )
        except IntegrityError:
            continue  # already fired for this period
        fired.append(alert)
        _send_spend_alert(organization=organization, alert=alert)
    return fired


def _send_spend_alert(*, organization: Organization, alert: SpendAlert) -> None:
    subject = f"Diptych: {organization.name} reached {alert.threshold_percent}% of its spend limit"
    body = (
        f"Spend in the period starting {alert.period_start:%Y-%m-%d} is ${alert.spent_micros / 1e6:,.2f} "
        f"of the ${alert.limit_micros / 1e6:,.2f} limit."
    )
    if alert.threshold_percent >= 100:
        body += " New requests are refused until the limit is raised or the period ends."
    logger.warning("%s. %s", subject, body)
    recipients = owner_emails(organization=organization)
    if recipients:
        send_mail(subject, body, settings.DEFAULT_FROM_EMAIL, recipients, fail_silently=True)


def invoice_lines_from_ledger(*, organization: Organization, period_start: date, book: PriceBook) -> list[RatedLine]:
    events = (
        UsageEvent.objects.filter(organization=organization, period_start=period_start)
        .only(*RATED_FIELDS)
        .iterator(chunk_size=2000)
    )
    tokens: dict[tuple[str, str, str, int | None], int] = defaultdict(int)
    for (_, _, model, phase, tier, _, price), count in _rate_events(events, book).items():
        if price is None:
            logger.error("No price for %s/%s: %d tokens of %s are not billed.", model, phase, count, organization)
        tokens[(model, phase, tier, price)] += count
    rows = [
        {"model": model, "phase": phase, "tier": tier, "unit_price_micros_per_million": price, "tokens": count}
        for (model, phase, tier, price), count in tokens.items()
    ]
    return rated_lines(rows)


def billing_periods_close(*, now: datetime | None = None) -> list[Invoice]:
    """Close every open period that has ended into an invoice; periods already closed are left alone."""
    now = now or timezone.now()
    due = BillingPeriod.objects.filter(status=PeriodStatus.OPEN, end__lte=now.date()).values_list("pk", flat=True)
    book = price_book()
    invoices = []
    for period_pk in list(due):
        invoice = _billing_period_close(period_pk=period_pk, book=book, now=now)
        if invoice is not None:
            invoices.append(invoice)
    return invoices


@transaction.atomic
def _billing_period_close(*, period_pk: int, book: PriceBook, now: datetime) -> Invoice | None:
    # The lock waits for ingests assigning events to this period; after it, late events go elsewhere.
    period = BillingPeriod.objects.select_for_update().select_related("organization").get(pk=period_pk)
    if period.status != PeriodStatus.OPEN:
        return None
    lines = invoice_lines_from_ledger(organization=period.organization, period_start=period.start, book=book)
    total_micros = sum(line.amount_micros for line in lines)
    period.status = PeriodStatus.CLOSED
    period.closed_at = now
    period.amount_to_date_micros = total_micros
    period.save(update_fields=["status", "closed_at", "amount_to_date_micros"])
    if not lines:
        return None
    total_cents = micros_to_cents(total_micros)
    invoice = Invoice.objects.create(
        organization=period.organization,
        period_start=period.start,
        period_end=period.end,
        total_micros=total_micros,
        total_cents=total_cents,
        # Stripe, too, counts an invoice with nothing to pay as paid.
        status=InvoiceStatus.DRAFT if total_cents else InvoiceStatus.PAID,
    )
    cents = allocate_cents([line.amount_micros for line in lines])
    InvoiceLine.objects.bulk_create(
        InvoiceLine(
            invoice=invoice,
            model=line.model,
            phase=line.phase,
            tier=line.tier,
            tokens=line.tokens,
            unit_price_micros_per_million=line.unit_price_micros_per_million,
            amount_micros=line.amount_micros,
            amount_cents=line_cents,
        )
        for line, line_cents in zip(lines, cents, strict=True)
    )
    logger.info("Closed %s into invoice %s: %d lines, %d cents.", period, invoice.public_id, len(lines), total_cents)
    return invoice


def _stripe_customer_ensure(*, organization: Organization, gateway: StripeGateway) -> str:
    account = BillingAccount.objects.filter(organization=organization).first()
    if account is not None:
        return account.stripe_customer_id
    emails = owner_emails(organization=organization)
    customer_id = gateway.create_customer(
        name=organization.name,
        email=emails[0] if emails else None,
        metadata={"organization_id": organization.public_id},
        idempotency_key=f"customer-{organization.public_id}",
    )
    BillingAccount.objects.create(organization=organization, stripe_customer_id=customer_id)
    return customer_id


def invoice_push(*, invoice: Invoice, gateway: StripeGateway) -> Invoice:
    """Send a draft invoice to Stripe (customer, one item per line, invoice, finalize); safe to retry."""
    if invoice.status != InvoiceStatus.DRAFT:
        raise InvalidInput(f"Invoice {invoice.public_id} is {invoice.status}; only drafts are sent to Stripe.")
    customer_id = _stripe_customer_ensure(organization=invoice.organization, gateway=gateway)
    for line in invoice.lines.all():
        if line.stripe_invoice_item_id:
            continue
        line.stripe_invoice_item_id = gateway.create_invoice_item(
            customer_id=customer_id,
            amount_cents=line.amount_cents,
            currency=invoice.currency,
            description=(
                f"{line.model} {line.phase}{' (batch)' if line.tier == PriceTier.BATCH else ''}: "
                f"{line.tokens:,} tokens × "
                f"${line.unit_price_micros_per_million / 1e6:.6f}/M tokens"
            ),
            metadata={"invoice_id": invoice.public_id, "line_id": str(line.pk)},
            idempotency_key=f"invoice-item-{invoice.public_id}-{line.pk}",
        )
        line.save(update_fields=["stripe_invoice_item_id"])
    if not invoice.stripe_invoice_id:
        invoice.stripe_invoice_id = gateway.create_invoice(
            customer_id=customer_id,
            description=f"Diptych usage {invoice.period_start:%Y-%m-%d} to {invoice.period_end:%Y-%m-%d}",
            metadata={"invoice_id": invoice.public_id, "organization_id": invoice.organization.public_id},
            idempotency_key=f"invoice-{invoice.public_id}",
        )
        invoice.save(update_fields=["stripe_invoice_id", "updated_at"])
    status = gateway.finalize_invoice(
        invoice_id=invoice.stripe_invoice_id, idempotency_key=f"invoice-finalize-{invoice.public_id}"
    )
    return invoice_status_set(invoice=invoice, stripe_status=status)


def invoice_status_set(*, invoice: Invoice, stripe_status: str | None) -> Invoice:
    if stripe_status not in STRIPE_INVOICE_STATUSES:
        logger.warning("Ignoring unknown Stripe status %r for invoice %s.", stripe_status, invoice.public_id)
        return invoice
    if stripe_status != invoice.status:
        invoice.status = stripe_status
        invoice.save(update_fields=["status", "updated_at"])
    return invoice


def invoice_status_pull(*, invoice: Invoice, gateway: StripeGateway) -> Invoice:
    stripe_status = gateway.invoice_status(invoice_id=invoice.stripe_invoice_id)
    return invoice_status_set(invoice=invoice, stripe_status=stripe_status)


def invoices_sync_with_stripe(*, gateway: StripeGateway) -> int:
    """Push (or finish pushing) every draft and pull the status of every open invoice; returns how many."""
    touched = 0
    for invoice in Invoice.objects.filter(status=InvoiceStatus.DRAFT).select_related("organization"):
        invoice_push(invoice=invoice, gateway=gateway)
        touched += 1
    for invoice in Invoice.objects.filter(status=InvoiceStatus.OPEN).exclude(stripe_invoice_id=""):
        invoice_status_pull(invoice=invoice, gateway=gateway)
        touched += 1
    return touched


STATUS_BY_EVENT_TYPE = {
    "invoice.finalized": InvoiceStatus.OPEN,
    "invoice.paid": InvoiceStatus.PAID,
    "invoice.payment_succeeded": InvoiceStatus.PAID,
    "invoice.voided": InvoiceStatus.VOID,
    "invoice.marked_uncollectible": InvoiceStatus.UNCOLLECTIBLE,
}


@dataclass(frozen=True)
class WebhookOutcome:
    event_id: str
    duplicate: bool
    invoice_id: str | None


@transaction.atomic
def stripe_event_process(*, event) -> WebhookOutcome:
    """Apply a verified Stripe event once: an event id seen before is acknowledged and ignored."""
    try:
        with transaction.atomic():
            ProcessedStripeEvent.objects.create(event_id=event.id, event_type=event.type)
    except IntegrityError:
        return WebhookOutcome(event_id=event.id, duplicate=True, invoice_id=None)
    status = STATUS_BY_EVENT_TYPE.get(event.type)
    if status is None:
        return WebhookOutcome(event_id=event.id, duplicate=False, invoice_id=None)
    stripe_invoice_id = event.data.object.id
    invoice = Invoice.objects.filter(stripe_invoice_id=stripe_invoice_id).first()
    if invoice is None:
        logger.warning("Stripe event %s names invoice %s, which is not ours.", event.id, stripe_invoice_id)
        return WebhookOutcome(event_id=event.id, duplicate=False, invoice_id=None)
    invoice_status_set(invoice=invoice, stripe_status=status)
    return WebhookOutcome(event_id=event.id, duplicate=False, invoice_id=invoice.public_id)
