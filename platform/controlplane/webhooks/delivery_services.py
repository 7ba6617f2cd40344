"""The state changes of a delivery's tries, which delivery.py drives: a try's hold on its delivery, and each
try's record with what it makes of the delivery (delivered, due again later, or failed). Below the services
that create endpoints and events (services.py): nothing here sends or schedules anything."""

from datetime import datetime, timedelta

from django.conf import settings
from django.db import transaction
from django.db.models import Q

from controlplane.webhooks.models import DeliveryStatus, WebhookAttempt, WebhookDelivery
from controlplane.webhooks.sender import TryOutcome

BACKOFF_FACTOR = 3
# A try holds its delivery for its timeout and this much more; one that died holding it frees it then.
LEASE_MARGIN = timedelta(seconds=30)


def retry_delay(tries_made: int) -> timedelta:
    """The wait after try `tries_made` failed: the first retry's, three times longer after each next try."""
    return timedelta(seconds=settings.DIPTYCH_WEBHOOK_FIRST_RETRY_SECONDS * BACKOFF_FACTOR ** (tries_made - 1))


def delivery_claim(*, delivery_id: int, now: datetime) -> WebhookDelivery | None:
    """The delivery, held for one try, if it is pending, due and held by no other try."""
    lease_until = now + timedelta(seconds=settings.DIPTYCH_WEBHOOK_TIMEOUT_SECONDS) + LEASE_MARGIN
    free = Q(lease_until__isnull=True) | Q(lease_until__lt=now)
    claimed = WebhookDelivery.objects.filter(
        free, id=delivery_id, status=DeliveryStatus.PENDING, next_attempt_at__lte=now
    ).update(lease_until=lease_until)
    if not claimed:
        return None
    return WebhookDelivery.objects.select_related("event", "endpoint").get(id=delivery_id)


@transaction.atomic
def attempt_record(
    *, delivery: WebhookDelivery, outcome: TryOutcome, started_at: datetime, now: datetime, retries: bool = True
) -> WebhookDelivery | None:
    """Records the try and releases the delivery: delivered on a 2xx, else due again after the backoff while
    tries are left (`retries`; a test event gets one), failed once none is or the destination is refused.
    None when the delivery is gone (its endpoint was deleted during the try)."""
    if not list(WebhookDelivery.objects.select_for_update().filter(id=delivery.id).values_list("id", flat=True)):
        return None
    number = delivery.attempts + 1
    WebhookAttempt.objects.create(
        delivery=delivery,
        number=number,
        started_at=started_at,
        duration_ms=outcome.duration_ms,
        status_code=outcome.status_code,
        error=outcome.error,
    )
    delivery.attempts = number
    delivery.lease_until = None
    if outcome.succeeded:
        delivery.status, delivery.delivered_at, delivery.next_attempt_at = DeliveryStatus.DELIVERED, now, None
    elif outcome.refused or not retries or number >= settings.DIPTYCH_WEBHOOK_MAX_TRIES:
        delivery.status, delivery.next_attempt_at = DeliveryStatus.FAILED, None
    else:
        delivery.next_attempt_at = now + retry_delay(number)
    delivery.save(update_fields=["attempts", "lease_until", "status", "delivered_at", "next_attempt_at"])
    return delivery
