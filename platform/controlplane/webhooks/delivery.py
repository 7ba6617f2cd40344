"""Makes one try of a delivery: holds it, signs its event's body with the endpoint's secrets as of now, posts
it (sender.py) and records the outcome (delivery_services.py).

Delivery is at least once: a try whose answer was lost is made again, with the same `webhook-id` (the
event's id) and the same body, so that a receiver that keeps the ids it handled drops the repeat.
"""

import logging

from django.utils import timezone

from controlplane.webhooks.delivery_services import attempt_record, delivery_claim
from controlplane.webhooks.models import WebhookDelivery
from controlplane.webhooks.sender import post
from controlplane.webhooks.signing import event_body, signed_headers, signing_secrets

log = logging.getLogger(__name__)


def try_delivery(delivery_id: int, *, retries: bool = True) -> WebhookDelivery | None:
    """The delivery after one try, or None when it was not due (done, held by another try) or is gone."""
    started_at = timezone.now()
    delivery = delivery_claim(delivery_id=delivery_id, now=started_at)
    if delivery is None:
        return None
    event, endpoint = delivery.event, delivery.endpoint
    body = event_body(event)
    headers = signed_headers(event=event, body=body, keys=signing_secrets(endpoint, started_at), now=started_at)
    outcome = post(endpoint.url, body, headers)
    recorded = attempt_record(
        delivery=delivery, outcome=outcome, started_at=started_at, now=timezone.now(), retries=retries
    )
    if recorded is not None and not outcome.succeeded:
        log.info(
            "webhook %s of %s to %s: try %d failed (%s); now %s",
            recorded.public_id,
            event.public_id,
            endpoint.public_id,
            recorded.attempts,
            outcome.error,
            recorded.status,
        )
    return recorded
