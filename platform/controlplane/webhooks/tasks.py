from datetime import timedelta

from celery import shared_task
from django.conf import settings
from django.utils import timezone

from controlplane.webhooks.delivery import try_delivery
from controlplane.webhooks.models import DeliveryStatus
from controlplane.webhooks.selectors import delivery_ids_overdue


@shared_task
def deliver_webhook(delivery_id: int) -> None:
    """One try; a delivery still pending after it is tried again by a task due when its backoff ends."""
    delivery = try_delivery(delivery_id)
    if delivery is not None and delivery.status == DeliveryStatus.PENDING:
        deliver_webhook.apply_async((delivery_id,), eta=delivery.next_attempt_at)


@shared_task
def resume_webhook_deliveries() -> int:
    """Sends a task for each delivery whose try is overdue by a resume interval: a worker that stopped took
    its due tasks with it, or the broker was down when the delivery was made."""
    grace = timedelta(seconds=settings.DIPTYCH_WEBHOOK_RESUME_SECONDS)
    delivery_ids = delivery_ids_overdue(now=timezone.now(), grace=grace)
    for delivery_id in delivery_ids:
        deliver_webhook.delay(delivery_id)
    return len(delivery_ids)
