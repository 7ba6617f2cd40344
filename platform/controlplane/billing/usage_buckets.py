"""Usage and costs in time buckets, in the shapes of OpenAI's `GET /v1/organization/usage/completions` and
`GET /v1/organization/costs`.

Buckets are aligned to their width in UTC (a 1d bucket starts at midnight, a 1h one on the hour): the first
bucket is the one holding `start_time`, and a page holds `limit` of them from its cursor on (`page`: the
first bucket's start, in unix seconds). Usage is read from the ledger, each request's phases by the time the
request started, from `start_time` (inclusive) to `end_time` (exclusive). Costs are read from the daily
rollup that usage/daily and the invoices read, whole UTC days, each result's amount rounded once (rating.py).
"""

from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import UTC, date, datetime

from django.db.models import Count, Q, Sum
from django.db.models.functions import Coalesce, Trunc

from controlplane.billing.models import DailyUsage
from controlplane.billing.rating import micros_from_token_price_product
from controlplane.catalog.models import PricePhase, PriceTier
from controlplane.common.errors import InvalidInput
from controlplane.metering.models import Phase, UsageEvent
from controlplane.tenancy.models import Organization
from controlplane.tenancy.scoping import organization_rows

BUCKET_SECONDS = {"1m": 60, "1h": 3600, "1d": 86400}
BUCKET_TRUNCATION = {"1m": "minute", "1h": "hour", "1d": "day"}
MICROS_PER_DOLLAR = 1_000_000

USAGE_GROUP_FIELDS = {
    "project_id": "project__public_id",
    "api_key_id": "api_key__public_id",
    "model": "model",
    "batch": "tier",
}
COST_GROUP_FIELDS = ("project_id", "api_key_id", "line_item")
LINE_ITEM_PHASES = {PricePhase.PREFILL: "input", PricePhase.CACHED_PREFILL: "cached input", PricePhase.DECODE: "output"}


@dataclass(frozen=True)
class BucketPage:
    """The buckets of one page: their starts (unix seconds), their width, and the next page's cursor."""

    starts: list[int]
    width_s: int
    next_page: str | None

    @property
    def first(self) -> datetime:
        return datetime.fromtimestamp(self.starts[0], UTC)

    @property
    def end(self) -> datetime:
        return datetime.fromtimestamp(self.starts[-1] + self.width_s, UTC)


def bucket_page(*, start_time: int, end_time: int, width_s: int, limit: int, page: str | None) -> BucketPage:
    """The page of buckets from `page` (default: the first bucket), at most `limit`; InvalidInput for a cursor
    that names no bucket of the range."""
    first = start_time - start_time % width_s
    if end_time <= start_time:
        raise InvalidInput("end_time must be after start_time.", fields={"end_time": ["Must be after start_time."]})
    begin = first
    if page is not None:
        if not page.isdigit() or (int(page) - first) % width_s or not first <= int(page) < end_time:
            raise InvalidInput(
                "page is not a cursor of this query.", fields={"page": ["Not a next_page of this query."]}
            )
        begin = int(page)
    starts = list(range(begin, min(end_time, begin + limit * width_s), width_s))
    after = starts[-1] + width_s
    return BucketPage(starts=starts, width_s=width_s, next_page=str(after) if after < end_time else None)


def _bucketed(page: BucketPage, results: dict[int, list[dict]]) -> list[dict]:
    return [
        {"object": "bucket", "start_time": start, "end_time": start + page.width_s, "results": results.get(start, [])}
        for start in page.starts
    ]


def completions_usage(
    *,
    organization: Organization,
    page: BucketPage,
    start_time: int,
    end_time: int,
    bucket_width: str,
    group_by: Sequence[str] = (),
    project_ids: Sequence[str] = (),
    api_key_ids: Sequence[str] = (),
    models: Sequence[str] = (),
    batch: bool | None = None,
) -> list[dict]:
    """The page's buckets of organization.usage.completions.result: prompt tokens (cached ones included) as
    input, generated tokens as output, each request (execution) once."""
    since = max(page.first, datetime.fromtimestamp(start_time, UTC))
    until = min(page.end, datetime.fromtimestamp(end_time, UTC))
    events = organization_rows(UsageEvent, organization=organization).filter(
        started_at__gte=since, started_at__lt=until
    )
    if project_ids:
        events = events.filter(project__public_id__in=project_ids)
    if api_key_ids:
        events = events.filter(api_key__public_id__in=api_key_ids)
    if models:
        events = events.filter(model__in=models)
    if batch is not None:
        events = events.filter(tier=PriceTier.BATCH) if batch else events.exclude(tier=PriceTier.BATCH)
    fields = [USAGE_GROUP_FIELDS[name] for name in group_by]
    prefill, decode = Q(phase=Phase.PREFILL), Q(phase=Phase.DECODE)
    rows = (
        events.annotate(bucket=Trunc("started_at", BUCKET_TRUNCATION[bucket_width], tzinfo=UTC))
        .values("bucket", *fields)
        .annotate(
            input_tokens=Coalesce(Sum("tokens", filter=prefill), 0),
            input_cached_tokens=Coalesce(Sum("cached_tokens", filter=prefill), 0),
            output_tokens=Coalesce(Sum("tokens", filter=decode), 0),
            num_model_requests=Count("request_id", distinct=True),
        )
        .order_by("bucket", *fields)
    )
    results: dict[int, list[dict]] = defaultdict(list)
    for row in rows:
        results[int(row["bucket"].timestamp())].append(_usage_result(row, group_by))
    return _bucketed(page, results)


def _usage_result(row: dict, group_by: Sequence[str]) -> dict:
    grouped = {name: row[USAGE_GROUP_FIELDS[name]] if name in group_by else None for name in USAGE_GROUP_FIELDS}
    if grouped["batch"] is not None:
        grouped["batch"] = grouped["batch"] == PriceTier.BATCH
    return {
        "object": "organization.usage.completions.result",
        "input_tokens": row["input_tokens"],
        "output_tokens": row["output_tokens"],
        "input_cached_tokens": row["input_cached_tokens"],
        "input_uncached_tokens": row["input_tokens"] - row["input_cached_tokens"],
        "input_audio_tokens": 0,
        "output_audio_tokens": 0,
        "num_model_requests": row["num_model_requests"],
        **grouped,
        "user_id": None,
        "service_tier": None,
    }


def line_item(*, model: str, phase: str, tier: str) -> str:
    """ "diptych-tiny, input", "diptych-tiny, cached input", "diptych-tiny, output (batch)"."""
    suffix = " (batch)" if tier == PriceTier.BATCH else ""
    return f"{model}, {LINE_ITEM_PHASES.get(phase, phase)}{suffix}"


def costs(
    *,
    organization: Organization,
    page: BucketPage,
    group_by: Sequence[str] = (),
    project_ids: Sequence[str] = (),
    api_key_ids: Sequence[str] = (),
    line_items: Sequence[str] = (),
) -> list[dict]:
    """The page's daily buckets of organization.costs.result, in dollars, each result rounded once to whole
    micro-dollars as usage/daily rounds its rows."""
    usage = organization_rows(DailyUsage, organization=organization).filter(
        day__gte=page.first.date(), day__lt=page.end.date()
    )
    if project_ids:
        usage = usage.filter(api_key__project__public_id__in=project_ids)
    if api_key_ids:
        usage = usage.filter(api_key__public_id__in=api_key_ids)
    rows = (
        usage.values(
            "day", "api_key__project__public_id", "api_key__public_id", "model", "phase", "tier",
            "unit_price_micros_per_million",
        )
        .annotate(tokens=Sum("tokens"))
        .order_by()
    )  # fmt: skip
    exact: dict[tuple[date, tuple], int] = defaultdict(int)  # sum of tokens × unit price per (day, group)
    for row in rows:
        item = line_item(model=row["model"], phase=row["phase"], tier=row["tier"])
        if line_items and item not in line_items:
            continue
        values = {"project_id": row["api_key__project__public_id"], "api_key_id": row["api_key__public_id"]}
        group = tuple(item if name == "line_item" else values[name] for name in COST_GROUP_FIELDS if name in group_by)
        exact[(row["day"], group)] += row["tokens"] * (row["unit_price_micros_per_million"] or 0)
    results: dict[int, list[dict]] = defaultdict(list)
    for (day, group), product in sorted(exact.items(), key=lambda entry: (entry[0][0], [str(v) for v in entry[0][1]])):
        start = int(datetime(day.year, day.month, day.day, tzinfo=UTC).timestamp())
        grouped = dict(zip([name for name in COST_GROUP_FIELDS if name in group_by], group, strict=True))
        results[start].append(
            {
                "object": "organization.costs.result",
                "amount": {"value": micros_from_token_price_product(product) / MICROS_PER_DOLLAR, "currency": "usd"},
                "line_item": grouped.get("line_item"),
                "project_id": grouped.get("project_id"),
                "api_key_id": grouped.get("api_key_id"),
            }
        )
    return _bucketed(page, results)
