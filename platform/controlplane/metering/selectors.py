from collections import defaultdict
from dataclasses import dataclass
from datetime import UTC, date, datetime, time, timedelta

from django.db.models import Count, F, Max, Min, OuterRef, Q, QuerySet, Subquery, Sum
from django.db.models.functions import Coalesce, TruncDate

from controlplane.common.errors import ApplicationError, ObjectNotFound
from controlplane.common.querysets import where_given
from controlplane.metering.latency_sql import MillisecondsBetween, PercentileCont
from controlplane.metering.models import Phase, RateLimitRefusal, UsageEvent
from controlplane.metering.request_phases import RequestTimeline, request_timeline
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
    events = where_given(
        events, request_id=request_id, client_request_id=client_request_id, phase=phase, model=model, tier=tier
    )
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
    events = where_given(events, api_key__kind=api_key_kind, project__public_id=project_id)
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


# ---- requests and their phases -----------------------------------------------------------------------------

MAX_REQUEST_LOG_PAGE = 100


class AmbiguousRequestId(ApplicationError):
    error_type = "ambiguous_request_id"


def request_timeline_get(*, organization: Organization, request_id: str) -> RequestTimeline:
    """The request the gateway named `request_id` (its X-Request-Id, `exec_…`). An id that names no execution
    of the organization is also looked up as a client's own label of a request (`user` in the OpenAI API,
    `metadata.user_id` in Anthropic's): found when it labels exactly one request, else AmbiguousRequestId.
    Another organization's request is not found, as if it did not exist."""
    events = _request_events(organization).filter(request_id=request_id)
    if not events:
        labelled = list(
            organization_rows(UsageEvent, organization=organization)
            .filter(client_request_id=request_id)
            .values_list("request_id", flat=True)
            .distinct()
            .order_by("request_id")[:2]
        )
        if len(labelled) > 1:
            raise AmbiguousRequestId(
                f"{request_id!r} is no request's id, and more than one request carries it as the client's label: "
                "ask for one by its X-Request-Id, or list them with usage/request-log?client_request_id=.",
            )
        events = _request_events(organization).filter(request_id__in=labelled)
    found = list(events)
    if not found:
        raise ObjectNotFound(f"No request {request_id!r} in the usage of this organization.")
    return request_timeline(found)


@dataclass(frozen=True)
class RequestLogPage:
    """Requests newest first (by their first phase's start); the next page starts `after` the last id."""

    items: list[RequestTimeline]
    has_more: bool


def request_log(
    *,
    organization: Organization,
    start: date,
    end: date,
    limit: int,
    after: str | None = None,
    api_key_id: str | None = None,
    project_id: str | None = None,
    model: str | None = None,
    client_request_id: str | None = None,
) -> RequestLogPage:
    """The requests that started on the days start..end (UTC, both included), each with its phases."""
    events = organization_rows(UsageEvent, organization=organization)
    events = where_given(
        events,
        api_key__public_id=api_key_id,
        project__public_id=project_id,
        model=model,
        client_request_id=client_request_id,
    )
    requests = (
        events.values("request_id")
        .annotate(first_started_at=Min("started_at"))
        .filter(first_started_at__gte=_day_start(start), first_started_at__lt=_day_start(end + timedelta(days=1)))
        .order_by("-first_started_at", "-request_id")
    )
    if after:
        anchor = requests.filter(request_id=after).values_list("first_started_at", flat=True).first()
        if anchor is None:
            raise ObjectNotFound(f"after: no request {after!r} in this list.", fields={"after": ["Unknown id."]})
        requests = requests.filter(Q(first_started_at__lt=anchor) | Q(first_started_at=anchor, request_id__lt=after))
    ids = [row["request_id"] for row in requests[: limit + 1]]
    grouped: dict[str, list[UsageEvent]] = defaultdict(list)
    for event in _request_events(organization).filter(request_id__in=ids[:limit]):
        grouped[event.request_id].append(event)
    return RequestLogPage(items=[request_timeline(grouped[id_]) for id_ in ids[:limit]], has_more=len(ids) > limit)


def _request_events(organization: Organization) -> QuerySet[UsageEvent]:
    return organization_rows(UsageEvent, organization=organization).select_related("api_key", "project")


def _day_start(day: date) -> datetime:
    return datetime.combine(day, time.min, tzinfo=UTC)


LATENCY_PERCENTILES = {"p50": 0.5, "p90": 0.9, "p99": 0.99}


def latency_percentiles_daily(
    *,
    organization: Organization,
    start: date,
    end: date,
    model: str | None = None,
    api_key_id: str | None = None,
    project_id: str | None = None,
) -> list[dict]:
    """Rows of {day, model, requests, time_to_first_token_ms: {p50, p90, p99}, duration_ms: {…}} per day (UTC,
    by the request's start) and model, computed by the database (percentile_cont).

    A request counts by its prefill event: its time to first token is that event's wall time (from the
    gateway's Prefill call to the first token back, queueing included), its duration runs from there to its
    decode event's end (the prefill's end for a request ended by its first token). Choices 1..n-1 of an n > 1
    request, which have no prefill event of their own, run beside choice 0 and are left out."""
    prefills = organization_rows(UsageEvent, organization=organization).filter(
        phase=Phase.PREFILL, started_at__gte=_day_start(start), started_at__lt=_day_start(end + timedelta(days=1))
    )
    prefills = where_given(prefills, model=model, api_key__public_id=api_key_id, project__public_id=project_id)
    decode_finished_at = UsageEvent.objects.filter(
        organization=OuterRef("organization"), request_id=OuterRef("request_id"), phase=Phase.DECODE
    ).values("finished_at")[:1]
    measured = prefills.annotate(
        day=TruncDate("started_at"),
        first_token_ms=MillisecondsBetween("started_at", "finished_at"),
        total_ms=MillisecondsBetween("started_at", Coalesce(Subquery(decode_finished_at), "finished_at")),
    )
    percentiles = {
        f"{measure}_{name}": PercentileCont(measure, fraction=fraction)
        for measure in ("first_token_ms", "total_ms")
        for name, fraction in LATENCY_PERCENTILES.items()
    }
    rows = measured.values("day", "model").annotate(requests=Count("id"), **percentiles).order_by("day", "model")
    return [
        {
            "day": row["day"],
            "model": row["model"],
            "requests": row["requests"],
            "time_to_first_token_ms": {name: round(row[f"first_token_ms_{name}"], 3) for name in LATENCY_PERCENTILES},
            "duration_ms": {name: round(row[f"total_ms_{name}"], 3) for name in LATENCY_PERCENTILES},
        }
        for row in rows
    ]
