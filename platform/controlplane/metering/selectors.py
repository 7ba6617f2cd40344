from django.db.models import Count, F, QuerySet, Sum

from controlplane.metering.models import UsageEvent
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
