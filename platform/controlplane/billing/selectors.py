from collections import defaultdict
from dataclasses import dataclass
from datetime import date, datetime

from django.db.models import QuerySet, Sum
from django.utils import timezone

from controlplane.billing.models import (
    ROLLUP_CURSOR,
    BillingPeriod,
    DailyUsage,
    Invoice,
    RollupCursor,
    SpendAlert,
)
from controlplane.billing.periods import period_bounds, period_end_of, period_start_of
from controlplane.billing.rating import amount_micros, apportion, micros_from_token_price_product
from controlplane.catalog.models import PricePhase
from controlplane.common.errors import ObjectNotFound
from controlplane.tenancy.models import Organization, Project
from controlplane.tenancy.scoping import organization_rows

GROUP_BY_FIELDS = {
    "phase": "phase",
    "model": "model",
    "api_key": "api_key__public_id",
    "tier": "tier",
    "project": "api_key__project__public_id",  # a key never leaves its project
}


@dataclass(frozen=True)
class RatedLine:
    model: str
    phase: str
    tokens: int
    unit_price_micros_per_million: int
    amount_micros: int
    tier: str = "standard"


def rated_lines(rows) -> list[RatedLine]:
    """Invoice lines from rows of {model, phase, tier, unit_price_micros_per_million, tokens}; unpriced rows are
    left out."""
    lines = [
        RatedLine(
            model=row["model"],
            phase=row["phase"],
            tier=row["tier"],
            tokens=row["tokens"],
            unit_price_micros_per_million=row["unit_price_micros_per_million"],
            amount_micros=amount_micros(
                tokens=row["tokens"], unit_price_micros_per_million=row["unit_price_micros_per_million"]
            ),
        )
        for row in rows
        if row["unit_price_micros_per_million"] is not None and row["tokens"]
    ]
    return sorted(lines, key=lambda line: (line.model, line.phase, line.tier, line.unit_price_micros_per_million))


def period_lines_to_date(*, organization: Organization, period_start: date) -> list[RatedLine]:
    """The lines the period's invoice would have now, from the daily rollup."""
    rows = (
        organization_rows(DailyUsage, organization=organization)
        .filter(period_start=period_start)
        .values("model", "phase", "tier", "unit_price_micros_per_million")
        .annotate(tokens=Sum("tokens"))
        .order_by()
    )
    return rated_lines(rows)


def usage_daily(
    *,
    organization: Organization,
    start: date,
    end: date,
    group_by: str,
    api_key_kind: str | None = None,
    project_id: str | None = None,
) -> list[dict]:
    """Rows of {day, key, tokens, amount_micros} for start <= day <= end, amount rounded once per row; with
    `api_key_kind`, of the keys of that kind only; with `project_id`, of that project's keys only."""
    rows = (
        _usage_in_range(organization, start, end, api_key_kind, project_id)
        .values("day", GROUP_BY_FIELDS[group_by], "unit_price_micros_per_million")
        .annotate(tokens=Sum("tokens"))
        .order_by()
    )
    tokens: dict[tuple[date, str], int] = defaultdict(int)
    exact_amount: dict[tuple[date, str], int] = defaultdict(int)  # sum of tokens × unit price
    for row in rows:
        key = (row["day"], row[GROUP_BY_FIELDS[group_by]])
        tokens[key] += row["tokens"]
        exact_amount[key] += row["tokens"] * (row["unit_price_micros_per_million"] or 0)
    return [
        {
            "day": day,
            "key": key,
            "tokens": tokens[(day, key)],
            "amount_micros": micros_from_token_price_product(exact_amount[(day, key)]),
        }
        for day, key in sorted(tokens)
    ]


def _usage_in_range(
    organization: Organization, start: date, end: date, api_key_kind: str | None, project_id: str | None
) -> QuerySet[DailyUsage]:
    usage = organization_rows(DailyUsage, organization=organization).filter(day__gte=start, day__lte=end)
    if api_key_kind is not None:
        usage = usage.filter(api_key__kind=api_key_kind)
    if project_id is not None:
        usage = usage.filter(api_key__project__public_id=project_id)
    return usage


LINE_FIELDS = ("model", "phase", "tier", "unit_price_micros_per_million")


@dataclass(frozen=True)
class UsageTotals:
    """The spend of a range as an invoice of it would charge: each line (model × phase × tier × price) rounded
    once, then added (rating.py), and that total's share of each key of the grouping, in proportion to its exact
    amount, so that the keys add up to it. Never a sum of rounded daily rows: a range that holds the open
    period's usage costs what the period's invoice would."""

    total_micros: int
    totals: list[dict]  # {key, tokens, amount_micros}, in key order


def usage_totals(
    *,
    organization: Organization,
    start: date,
    end: date,
    group_by: str,
    api_key_kind: str | None = None,
    project_id: str | None = None,
) -> UsageTotals:
    usage = _usage_in_range(organization, start, end, api_key_kind, project_id)
    field = GROUP_BY_FIELDS[group_by]
    tokens: dict[str, int] = defaultdict(int)
    exact_amount: dict[str, int] = defaultdict(int)  # sum of tokens × unit price
    for row in usage.values(field, "unit_price_micros_per_million").annotate(tokens=Sum("tokens")).order_by():
        tokens[row[field]] += row["tokens"]
        exact_amount[row[field]] += row["tokens"] * (row["unit_price_micros_per_million"] or 0)
    lines = rated_lines(usage.values(*LINE_FIELDS).annotate(tokens=Sum("tokens")).order_by())
    total = sum(line.amount_micros for line in lines)
    keys = sorted(tokens, key=str)
    shares = apportion(total, [exact_amount[key] for key in keys])
    totals = [
        {"key": key, "tokens": tokens[key], "amount_micros": share} for key, share in zip(keys, shares, strict=True)
    ]
    return UsageTotals(total_micros=total, totals=totals)


@dataclass(frozen=True)
class PeriodCosts:
    """The open period's usage rated with the price book, as of the last rollup.

    `rows` are per day × model × billed phase × tier, each rounded once (the usage-report rule of rating.py);
    `phases` and `total_micros` add up the period's invoice lines, so the total is what the invoice would be now.
    A late event of a closed period is billed here but keeps its real day, so a row's day may precede the start.
    """

    period_start: date
    period_end: date
    as_of: datetime | None
    total_micros: int
    phases: list[dict]
    rows: list[dict]


def period_costs(*, organization: Organization, now: datetime | None = None) -> PeriodCosts:
    start = period_start_of(now or timezone.now())
    daily = (
        organization_rows(DailyUsage, organization=organization)
        .filter(period_start=start)
        .values("day", "model", "phase", "tier", "unit_price_micros_per_million")
        .annotate(tokens=Sum("tokens"))
        .order_by()
    )
    tokens: dict[tuple[date, str, str, str], int] = defaultdict(int)
    exact_amount: dict[tuple[date, str, str, str], int] = defaultdict(int)  # sum of tokens × unit price
    for row in daily:
        key = (row["day"], row["model"], row["phase"], row["tier"])
        tokens[key] += row["tokens"]
        exact_amount[key] += row["tokens"] * (row["unit_price_micros_per_million"] or 0)
    rows = [
        {
            **dict(zip(("day", "model", "phase", "tier"), key, strict=True)),
            "tokens": tokens[key],
            "amount_micros": micros_from_token_price_product(exact_amount[key]),
        }
        for key in sorted(tokens)
    ]
    lines = period_lines_to_date(organization=organization, period_start=start)
    phases = [
        {
            "phase": phase,
            "tokens": sum(count for (_, _, row_phase, _), count in tokens.items() if row_phase == phase),
            "amount_micros": sum(line.amount_micros for line in lines if line.phase == phase),
        }
        for phase in PricePhase.values
    ]
    cursor = RollupCursor.objects.filter(name=ROLLUP_CURSOR).first()
    return PeriodCosts(
        period_start=start,
        period_end=period_end_of(start),
        as_of=cursor.ingested_before if cursor is not None else None,
        total_micros=sum(line.amount_micros for line in lines),
        phases=phases,
        rows=rows,
    )


def billing_period_current(*, organization: Organization, now: datetime | None = None) -> BillingPeriod | None:
    start = period_start_of(now or timezone.now())
    return organization_rows(BillingPeriod, organization=organization).filter(start=start).first()


def spend_status(*, organization: Organization, now: datetime | None = None) -> dict:
    """{limit_micros, spent_micros, over_limit} for the period open now, as of the last rollup."""
    period = billing_period_current(organization=organization, now=now)
    spent = period.amount_to_date_micros if period is not None else 0
    limit = organization.spend_limit_micros
    return {"limit_micros": limit, "spent_micros": spent, "over_limit": limit is not None and spent >= limit}


def project_spend_status(*, project: Project, now: datetime | None = None) -> dict:
    """{limit_micros, spent_micros, over_limit} of the project in the period open now, as of the last rollup:
    the period's invoice lines counted over the project's keys only."""
    rows = (
        organization_rows(DailyUsage, organization=project.organization)
        .filter(api_key__project=project, period_start=period_start_of(now or timezone.now()))
        .values("model", "phase", "tier", "unit_price_micros_per_million")
        .annotate(tokens=Sum("tokens"))
        .order_by()
    )
    spent = sum(line.amount_micros for line in rated_lines(rows))
    limit = project.spend_limit_micros
    return {"limit_micros": limit, "spent_micros": spent, "over_limit": limit is not None and spent >= limit}


def billing_current(*, organization: Organization, now: datetime | None = None) -> dict:
    now = now or timezone.now()
    start = period_start_of(now)
    period = billing_period_current(organization=organization, now=now)
    amount = period.amount_to_date_micros if period is not None else 0
    begins, ends = period_bounds(start)
    elapsed = max(int((now - begins).total_seconds()), 1)
    length = int((ends - begins).total_seconds())
    alerts = organization_rows(SpendAlert, organization=organization).filter(period_start=start)
    return {
        "period_start": start,
        "period_end": period_end_of(start),
        "currency": "usd",
        "amount_to_date_micros": amount,
        "projected_micros": amount * length // elapsed,
        "spend_limit_micros": organization.spend_limit_micros,
        "alerts": alerts.order_by("threshold_percent"),
    }


def invoice_list(*, organization: Organization, status: str | None = None) -> QuerySet[Invoice]:
    invoices = organization_rows(Invoice, organization=organization).prefetch_related("lines")
    if status is not None:
        invoices = invoices.filter(status=status)
    return invoices.order_by("-period_start", "-id")


def invoice_get(*, organization: Organization, public_id: str) -> Invoice:
    invoice = invoice_list(organization=organization).filter(public_id=public_id).first()
    if invoice is None:
        raise ObjectNotFound(f"Invoice {public_id!r} not found.")
    return invoice
