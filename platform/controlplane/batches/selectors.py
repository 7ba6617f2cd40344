from dataclasses import dataclass
from datetime import datetime

from django.db.models import Count, Q, QuerySet, Sum

from controlplane.batches.models import ACTIVE_BATCH_STATUSES, Batch, BatchLine, File, LineState
from controlplane.catalog.models import Model
from controlplane.common.errors import ObjectNotFound
from controlplane.tenancy.models import ApiKey, Organization
from controlplane.tenancy.scoping import organization_rows


@dataclass(frozen=True)
class RequestCounts:
    total: int
    completed: int
    failed: int


@dataclass(frozen=True)
class BatchUsage:
    """The tokens of a batch's answered lines, in the shape of OpenAI's batch usage."""

    input_tokens: int
    cached_tokens: int
    output_tokens: int
    reasoning_tokens: int = 0  # no model here reasons apart from its answer

    @property
    def total_tokens(self) -> int:
        return self.input_tokens + self.output_tokens


def file_list(*, organization: Organization, purpose: str | None = None) -> QuerySet[File]:
    files = organization_rows(File, organization=organization).defer("content")
    if purpose is not None:
        files = files.filter(purpose=purpose)
    return files.order_by("-id")


def file_get(*, organization: Organization, public_id: str) -> File:
    file = organization_rows(File, organization=organization).filter(public_id=public_id).first()
    if file is None:
        raise ObjectNotFound(f"No file with id {public_id!r}.")
    return file


def batch_list(*, organization: Organization) -> QuerySet[Batch]:
    batches = organization_rows(Batch, organization=organization).select_related("output_file", "error_file")
    return batches.defer("output_file__content", "error_file__content")


def batch_get(*, organization: Organization, public_id: str) -> Batch:
    batch = batch_list(organization=organization).filter(public_id=public_id).first()
    if batch is None:
        raise ObjectNotFound(f"No batch with id {public_id!r}.")
    return batch


def request_counts(*, batch: Batch) -> RequestCounts:
    counts = BatchLine.objects.filter(batch=batch).aggregate(
        total=Count("id"),
        completed=Count("id", filter=Q(state=LineState.SUCCEEDED)),
        failed=Count("id", filter=Q(state__in=[LineState.FAILED, LineState.NOT_RUN])),
    )
    return RequestCounts(**counts)


def batch_usage(*, batch: Batch) -> BatchUsage:
    """The sum of the usage of the batch's lines answered so far."""
    names = ("input_tokens", "cached_tokens", "output_tokens")
    sums = BatchLine.objects.filter(batch=batch).aggregate(**{name: Sum(name, default=0) for name in names})
    return BatchUsage(**sums)


def lines_ready(
    *, batch: Batch, now: datetime, exclude: set[int], limit: int, sent_only: bool = False
) -> list[BatchLine]:
    """Unanswered lines that may be sent now, in file order, other than those already on their way;
    `sent_only`: only those sent before, whose answers are still to be had."""
    lines = BatchLine.objects.filter(batch=batch, state=LineState.PENDING).exclude(id__in=exclude)
    if sent_only:
        lines = lines.filter(sent_at__isnull=False)
    lines = lines.filter(Q(not_before__isnull=True) | Q(not_before__lte=now))
    return list(lines.order_by("line_number")[:limit])


def lines_pending_count(*, batch: Batch) -> int:
    return BatchLine.objects.filter(batch=batch, state=LineState.PENDING).count()


def lines_sent_unanswered_count(*, batch: Batch) -> int:
    """Lines the gateway may have run whose answers the batch does not have yet."""
    return BatchLine.objects.filter(batch=batch, state=LineState.PENDING, sent_at__isnull=False).count()


def batch_ids_without_runner(*, now: datetime) -> list[int]:
    """Active batches no runner holds: never started, or their runner stopped and its lease ran out."""
    batches = Batch.objects.filter(status__in=ACTIVE_BATCH_STATUSES)
    return list(batches.filter(Q(lease_until__isnull=True) | Q(lease_until__lt=now)).values_list("id", flat=True))


def batch_of_runner_key(*, api_key: ApiKey) -> Batch | None:
    """The batch whose runner sends requests with `api_key`, if any: its usage is billed at the batch tier."""
    return Batch.objects.filter(runner_key=api_key).first()


def lines_naming_unknown_models(*, batch: Batch) -> list[tuple[int, object]]:
    """(line number, body.model) of each line whose model the catalog does not serve, in line order."""
    known = set(Model.objects.values_list("name", flat=True))
    lines = BatchLine.objects.filter(batch=batch).order_by("line_number").values_list("line_number", "body")
    models = [(number, body.get("model")) for number, body in lines]
    return [(number, model) for number, model in models if not isinstance(model, str) or model not in known]
