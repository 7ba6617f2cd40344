from datetime import date

from django.db.models import Count, F, Max, QuerySet, Sum
from django.db.models.functions import TruncDate

from controlplane.metering.models import RateLimitRefusal, UsageEvent
from controlplane.tenancy.models import Organization
from controlplane.tenancy.scoping import organization_rows


def usage_event_list(
    *,
    organization: Organization,
    request_id: str | None = None,
    client_request_id: str | None = None,
    phase: str | None = None,
    model: str | None = None,
    tier: str | None = None,
) -> QuerySet[UsageEvent]:
    events = organization_rows(UsageEvent, organization=organization).select_related("organization", "api_key")
    if request_id is not None:
        events = events.filter(request_id=request_id)
    if client_request_id is not None:
        events = events.filter(client_request_id=client_request_id)
    if phase is not None:
        events = events.filter(phase=phase)
    if model is not None:
        events = events.filter(model=model)
    if tier is not None:
        events = events.filter(tier=tier)
    return events.order_by("-started_at", "-id")


def usage_summary(*, organization: Organization) -> QuerySet:
    """Totals per (model, phase, tier): rows of {model, phase, tier, requests, tokens, cached_tokens}.

    Cached tokens are counted beside `tokens`, never inside, as usage/daily and invoices count them: a
    prefill row's `tokens` are those billed at the prefill price and its `cached_tokens` those billed at
    the cached-prefill price (a ledger event's `tokens` include its `cached_tokens`)."""
    return (
        organization_rows(UsageEvent, organization=organization)
        .values("model", "phase", "tier")
        .annotate(
            requests=Count("id"), tokens=Sum(F("tokens") - F("cached_tokens")), cached_tokens=Sum("cached_tokens")
        )
        .order_by("model", "phase", "tier")
    )


REQUEST_GROUP_BY_FIELDS = {
    "api_key": "api_key__public_id",
    "model": "model",
    "tier": "tier",
    "project": "project__public_id",
}


def request_counts_daily(
    *,
    organization: Organization,
    start: date,
    end: date,
    group_by: str,
    api_key_kind: str | None = None,
    project_id: str | None = None,
) -> list[dict]:
    """Rows of {day, key, requests} for start <= day <= end (UTC, by the time a request started): how many
    requests each API key, model, tier or project made, counted from the ledger (a request's phases count
    once); with `project_id`, of that project only."""
    field = REQUEST_GROUP_BY_FIELDS[group_by]
    events = organization_rows(UsageEvent, organization=organization).annotate(day=TruncDate("started_at"))
    if api_key_kind is not None:
        events = events.filter(api_key__kind=api_key_kind)
    if project_id is not None:
        events = events.filter(project__public_id=project_id)
    rows = (
        events.filter(day__gte=start, day__lte=end)
        .values("day", field)
        .annotate(requests=Count("request_id", distinct=True))
        .order_by("day", field)
    )
    return [{"day": row["day"], "key": row[field], "requests": row["requests"]} for row in rows]


def rate_limit_refusals_daily(*, organization: Organization, start: date, end: date) -> list[dict]:
    """Rows of {day, api_key_id, api_key_name, scope, limit, limit_value, refusals, last_refused_at}: the
    requests each limit refused for each API key per day (UTC), latest day first."""
    rows = (
        organization_rows(RateLimitRefusal, organization=organization)
        .annotate(day=TruncDate("minute"))
        .filter(day__gte=start, day__lte=end)
        .values("day", "api_key__public_id", "api_key__name", "scope", "limit", "limit_value")
        .annotate(refusals=Sum("refusals"), last_refused_at=Max("minute"))
        .order_by("-day", "-last_refused_at", "api_key__public_id", "scope", "limit")
    )
    return [
        {
            "day": row["day"],
            "api_key_id": row["api_key__public_id"],
            "api_key_name": row["api_key__name"],
            "scope": row["scope"],
            "limit": row["limit"],
            "limit_value": row["limit_value"],
            "refusals": row["refusals"],
            "last_refused_at": row["last_refused_at"],
        }
        for row in rows
    ]
