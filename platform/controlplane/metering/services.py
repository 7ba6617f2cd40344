import logging
from collections.abc import Collection, Sequence
from dataclasses import dataclass
from datetime import date, datetime
from typing import Protocol

from django.utils import timezone

from controlplane.common.errors import InvalidInput
from controlplane.metering.models import RateLimitRefusal, UsageEvent
from controlplane.tenancy.models import ApiKey, Organization
from diptych_common.internal_api import messages

logger = logging.getLogger(__name__)

MAX_EVENTS_PER_BATCH = 1000


@dataclass(frozen=True)
class IngestResult:
    accepted: int
    duplicates: int


@dataclass(frozen=True)
class NewUsage:
    """The events of a batch that the ledger does not hold yet, each with its API key."""

    events: list[tuple[messages.UsageEvent, ApiKey]]
    received: int  # events in the batch, repeats included


def usage_batch_new(*, reports: Sequence[messages.UsageEvent]) -> NewUsage:
    """The batch's events not stored before, first of each (request_id, phase) only; reads, writes nothing.

    InvalidInput lists every unknown or mismatched reference. The first write of an event wins: a repeat
    with different content is logged and dropped.
    """
    api_keys = _resolve_api_keys(reports)
    first_reports: dict[tuple[str, str], messages.UsageEvent] = {}
    for report in reports:
        first = first_reports.setdefault(report.idempotency_key, report)
        if first is not report and first != report:
            _warn_conflicting_duplicate(report.idempotency_key, "an earlier event of the same batch")

    stored = _stored_events(keys=first_reports.keys())
    for key, report in first_reports.items():
        if key in stored and not _same_content(stored[key], report, api_keys[report.api_key_id]):
            _warn_conflicting_duplicate(key, "the stored event")
    events = [(report, api_keys[report.api_key_id]) for key, report in first_reports.items() if key not in stored]
    return NewUsage(events=events, received=len(reports))


def usage_events_store(*, new: NewUsage, period_starts: Sequence[date], ingested_at: datetime) -> IngestResult:
    """Appends the new events to the ledger, the i-th billed in the period starting `period_starts[i]`.

    Runs in the transaction that read `new` and assigned the periods (billing.services.usage_events_ingest).
    """
    fresh = [
        _new_event(report, api_key=api_key, ingested_at=ingested_at, period_start=period_start)
        for (report, api_key), period_start in zip(new.events, period_starts, strict=True)
    ]
    UsageEvent.objects.bulk_create(fresh, ignore_conflicts=True)
    # A concurrent batch can store some of the same events between our read and our insert; the
    # conflicts are then skipped silently, so count only the rows stamped by this call.
    accepted = UsageEvent.objects.filter(
        request_id__in={event.request_id for event in fresh}, ingested_at=ingested_at
    ).count()
    return IngestResult(accepted=accepted, duplicates=new.received - accepted)


class KeyedReport(Protocol):
    """A gateway's report about an API key of an organization (a usage event, a count of refusals)."""

    @property
    def organization_id(self) -> str: ...

    @property
    def api_key_id(self) -> str: ...


def _resolve_api_keys(reports: Sequence[KeyedReport], items: str = "events") -> dict[str, ApiKey]:
    """The API keys the batch names, by public id; InvalidInput lists every unknown or mismatched reference
    (`items`: the name of the batch's list in the request body)."""
    organization_ids = {report.organization_id for report in reports}
    known_organizations = set(
        Organization.objects.filter(public_id__in=organization_ids).values_list("public_id", flat=True)
    )
    api_keys = {
        api_key.public_id: api_key
        for api_key in ApiKey.objects.select_related("organization").filter(
            public_id__in={report.api_key_id for report in reports}
        )
    }
    problems: dict[str, list[str]] = {}
    for index, report in enumerate(reports):
        api_key = api_keys.get(report.api_key_id)
        if report.organization_id not in known_organizations:
            problems[f"{items}[{index}].organization_id"] = [f"Unknown organization {report.organization_id!r}."]
        elif api_key is None:
            problems[f"{items}[{index}].api_key_id"] = [f"Unknown API key {report.api_key_id!r}."]
        elif api_key.organization.public_id != report.organization_id:
            problems[f"{items}[{index}].api_key_id"] = [
                f"API key {report.api_key_id!r} does not belong to organization {report.organization_id!r}."
            ]
    if problems:
        first_path, first_messages = next(iter(problems.items()))
        summary = f"{first_path}: {first_messages[0]}"
        if len(problems) > 1:
            summary += f" (and {len(problems) - 1} more)"
        raise InvalidInput(f"Nothing was stored. {summary}", fields=problems)
    return api_keys


def _stored_events(*, keys: Collection[tuple[str, str]]) -> dict[tuple[str, str], UsageEvent]:
    request_ids = {request_id for request_id, _ in keys}
    return {
        (event.request_id, event.phase): event
        for event in UsageEvent.objects.filter(request_id__in=request_ids)
        if (event.request_id, event.phase) in keys
    }


def _new_event(
    report: messages.UsageEvent, *, api_key: ApiKey, ingested_at: datetime, period_start: date
) -> UsageEvent:
    return UsageEvent(
        request_id=report.request_id,
        phase=report.phase,
        organization_id=api_key.organization_id,
        api_key=api_key,
        project_id=api_key.project_id,  # a key stays in its project, so the key's project is the usage's
        ingested_at=ingested_at,
        period_start=period_start,
        **_ledger_values(report),
    )


COMPARED_FIELDS = [
    "client_request_id",
    "model",
    "region",
    "worker_id",
    "tokens",
    "cached_tokens",
    "kv_bytes",
    "compute_ms",
    "started_at",
    "finished_at",
    "tier",
]


def _ledger_values(report: messages.UsageEvent) -> dict[str, object]:
    """The reported fields a repeat of a stored event must match, as the ledger stores them."""
    values = {field: getattr(report, field) for field in COMPARED_FIELDS}
    return values | {name: datetime.fromisoformat(values[name]) for name in ("started_at", "finished_at")}


def _same_content(event: UsageEvent, report: messages.UsageEvent, api_key: ApiKey) -> bool:
    return event.api_key_id == api_key.pk and all(
        getattr(event, field) == value for field, value in _ledger_values(report).items()
    )


def _warn_conflicting_duplicate(key: tuple[str, str], earlier: str) -> None:
    request_id, phase = key
    logger.warning(
        "Usage event (request_id=%r, phase=%r) differs from %s; keeping the first one.", request_id, phase, earlier
    )


# ---- refusals by a rate limit ------------------------------------------------------------------------------


def rate_limit_refusals_record(*, reports: Sequence[messages.RefusalReport]) -> IngestResult:
    """Stores the gateway's counts of refused requests; a report sent again (same id) counts once."""
    api_keys = _resolve_api_keys(reports, items="refusals")
    ingested_at = timezone.now()
    RateLimitRefusal.objects.bulk_create(
        [
            RateLimitRefusal(
                report_id=report.id,
                organization=api_keys[report.api_key_id].organization,
                api_key=api_keys[report.api_key_id],
                scope=report.scope,
                limit=report.limit,
                limit_value=report.limit_value,
                minute=datetime.fromisoformat(report.minute).replace(second=0, microsecond=0),
                refusals=report.refusals,
                ingested_at=ingested_at,
            )
            for report in reports
        ],
        ignore_conflicts=True,
    )
    accepted = RateLimitRefusal.objects.filter(
        report_id__in={report.id for report in reports}, ingested_at=ingested_at
    ).count()
    return IngestResult(accepted=accepted, duplicates=len(reports) - accepted)
