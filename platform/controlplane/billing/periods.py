"""Monthly billing periods (UTC calendar months) and which one a usage event is billed in.

Late events: an event is billed in the period of its `started_at` while that period is open; once the
period is closed (invoiced), an event arriving for it is billed in the organization's period that is
open now. Its `started_at` is never changed, so usage by day still shows it on its real day.
"""

from collections.abc import Iterable
from datetime import UTC, date, datetime

from django.utils import timezone

from controlplane.billing.models import BillingPeriod, PeriodStatus


def period_start_of(moment: datetime) -> date:
    utc = moment.astimezone(UTC)
    return date(utc.year, utc.month, 1)


def period_end_of(start: date) -> date:
    return date(start.year + start.month // 12, start.month % 12 + 1, 1)


def period_bounds(start: date) -> tuple[datetime, datetime]:
    """The period as [from, to) datetimes in UTC."""
    end = period_end_of(start)
    return (
        datetime(start.year, start.month, 1, tzinfo=UTC),
        datetime(end.year, end.month, 1, tzinfo=UTC),
    )


def billing_period_ensure(*, organization_id: int, start: date) -> BillingPeriod:
    period, _ = BillingPeriod.objects.get_or_create(
        organization_id=organization_id, start=start, defaults={"end": period_end_of(start)}
    )
    return period


def billing_periods_assign(
    *, wanted: Iterable[tuple[int, date]], now: datetime | None = None
) -> dict[tuple[int, date], date]:
    """For each (organization id, period start of an event), the period start it is billed in.

    Must run inside the ingest transaction: the period rows stay locked until it commits, so closing a
    period waits for events being assigned to it, and an event never lands in a period closed under it.
    """
    current = period_start_of(now or timezone.now())
    wanted = set(wanted)
    keys = sorted(wanted | {(organization_id, current) for organization_id, _ in wanted})
    for organization_id, start in keys:
        billing_period_ensure(organization_id=organization_id, start=start)
    organization_ids = {organization_id for organization_id, _ in keys}
    locked = (
        BillingPeriod.objects.select_for_update()
        .filter(organization_id__in=organization_ids, start__in={start for _, start in keys})
        .order_by("organization_id", "start")
    )
    closed = {(p.organization_id, p.start) for p in locked if p.status == PeriodStatus.CLOSED}
    return {key: (current if key in closed else key[1]) for key in wanted}
