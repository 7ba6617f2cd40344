"""Webhook endpoints (create, delete, rotate the secret, send a test event) and events: `emit_event` stores an
event and one delivery per subscribed endpoint in the caller's transaction and hands each delivery to a
Celery task once it commits (tasks.py), whose tries are delivery.py's."""

from dataclasses import dataclass
from datetime import timedelta

from django.db import transaction
from django.utils import timezone

from controlplane.common.errors import InvalidInput
from controlplane.common.ids import new_public_id
from controlplane.tenancy.access import SYSTEM, Principal
from controlplane.tenancy.models import Organization
from controlplane.tenancy.services import audit_record
from controlplane.webhooks.addresses import HostUnresolved, UnsafeDestination, resolve
from controlplane.webhooks.delivery import try_delivery
from controlplane.webhooks.models import (
    EventType,
    WebhookDelivery,
    WebhookEndpoint,
    WebhookEvent,
)
from controlplane.webhooks.selectors import endpoint_list, endpoints_subscribed
from controlplane.webhooks.signing import new_secret
from controlplane.webhooks.tasks import deliver_webhook

MAX_ENDPOINTS_PER_ORGANIZATION = 20
SUBJECT_ID_MAX_LENGTH = 64
# How long the secret before a rotation keeps signing beside the new one, so that receivers can switch.
SECRET_OVERLAP = timedelta(hours=24)
TEST_SUBJECT_PREFIXES = {"batch": "batch", "response": "resp"}


# ---- endpoints -------------------------------------------------------------------------------------------


def check_url(url: str) -> None:
    """Refuses a URL no delivery may go to. A host that does not resolve yet is accepted: its tries record
    that, and each try checks the addresses the host has then."""
    try:
        resolve(url)
    except HostUnresolved:
        return
    except UnsafeDestination as refusal:
        raise InvalidInput(f"url: {refusal}", fields={"url": [str(refusal)]}) from None


def check_event_types(event_types: list[str]) -> list[str]:
    unknown = [event_type for event_type in event_types if event_type not in EventType.values]
    if unknown:
        raise InvalidInput(
            f"event_types: unknown event type {unknown[0]!r}; use some of {', '.join(EventType.values)}.",
            fields={"event_types": [f"Unknown event type {event_type!r}." for event_type in unknown]},
        )
    if not event_types:
        raise InvalidInput("event_types: name at least one event type.", fields={"event_types": ["Empty."]})
    repeated = sorted({event_type for event_type in event_types if event_types.count(event_type) > 1})
    if repeated:
        raise InvalidInput(
            f"event_types: {repeated[0]!r} is named more than once.", fields={"event_types": ["Repeats a type."]}
        )
    return [event_type for event_type in EventType.values if event_type in event_types]


@transaction.atomic
def endpoint_create(
    *, organization: Organization, url: str, event_types: list[str], name: str = "", actor: Principal = SYSTEM
) -> WebhookEndpoint:
    event_types = check_event_types(event_types)
    check_url(url)
    # Counted under a lock on the organization, so that two creates at once cannot both take the last place.
    Organization.objects.select_for_update().filter(pk=organization.pk).first()
    if endpoint_list(organization=organization).count() >= MAX_ENDPOINTS_PER_ORGANIZATION:
        raise InvalidInput(
            f"An organization has at most {MAX_ENDPOINTS_PER_ORGANIZATION} webhook endpoints; delete one first."
        )
    endpoint = WebhookEndpoint.objects.create(
        organization=organization, name=name, url=url, event_types=event_types, secret=new_secret()
    )
    audit_record(
        actor=actor,
        organization=organization,
        action="webhook_endpoint.create",
        target_type="webhook_endpoint",
        target_id=endpoint.public_id,
        details={"url": url, "event_types": event_types},
    )
    return endpoint


@transaction.atomic
def endpoint_delete(*, endpoint: WebhookEndpoint, actor: Principal = SYSTEM) -> None:
    """Deletes the endpoint with its deliveries: a try on its way finds nothing to record and stops."""
    audit_record(
        actor=actor,
        organization=endpoint.organization,
        action="webhook_endpoint.delete",
        target_type="webhook_endpoint",
        target_id=endpoint.public_id,
        details={"url": endpoint.url},
    )
    endpoint.delete()


@transaction.atomic
def endpoint_rotate_secret(
    *, endpoint: WebhookEndpoint, keep_old_secret: bool = True, actor: Principal = SYSTEM
) -> WebhookEndpoint:
    """A new secret signs every delivery from now on; with `keep_old_secret` the one it replaces signs beside
    it for SECRET_OVERLAP (a delivery then carries both signatures), else it stops at once."""
    endpoint = WebhookEndpoint.objects.select_for_update().get(pk=endpoint.pk)
    now = timezone.now()
    endpoint.previous_secret = endpoint.secret if keep_old_secret else ""
    endpoint.previous_secret_until = now + SECRET_OVERLAP if keep_old_secret else None
    endpoint.secret = new_secret()
    endpoint.updated_at = now
    endpoint.save(update_fields=["previous_secret", "previous_secret_until", "secret", "updated_at"])
    audit_record(
        actor=actor,
        organization=endpoint.organization,
        action="webhook_endpoint.rotate_secret",
        target_type="webhook_endpoint",
        target_id=endpoint.public_id,
        details={"old_secret_valid_until": endpoint.previous_secret_until.isoformat() if keep_old_secret else None},
    )
    return endpoint


@dataclass(frozen=True)
class TestResult:
    endpoint: WebhookEndpoint
    event_type: str
    delivery: WebhookDelivery


def endpoint_send_test(*, endpoint: WebhookEndpoint, event_type: str) -> TestResult:
    """Sends a sample event of `event_type` (about an object that does not exist) to this endpoint alone,
    once, now; the try is recorded among its deliveries."""
    check_event_types([event_type])
    with transaction.atomic():
        subject = new_public_id(TEST_SUBJECT_PREFIXES[event_type.partition(".")[0]])
        event = WebhookEvent.objects.create(
            organization_id=endpoint.organization_id, type=event_type, subject_id=subject, data={"id": subject}
        )
        delivery = WebhookDelivery.objects.create(event=event, endpoint=endpoint, next_attempt_at=event.created_at)
    try_delivery(delivery.id, retries=False)
    delivery.refresh_from_db()
    return TestResult(endpoint=endpoint, event_type=event_type, delivery=delivery)


# ---- events ----------------------------------------------------------------------------------------------


def _checked_data(data: dict) -> dict:
    subject = data.get("id") if isinstance(data, dict) else None
    if set(data if isinstance(data, dict) else ()) != {"id"} or not isinstance(subject, str):
        raise InvalidInput('data must be {"id": "<the object\'s id>"}.', fields={"data": ["Only an id."]})
    if not 1 <= len(subject) <= SUBJECT_ID_MAX_LENGTH:
        raise InvalidInput(
            f"data.id must be 1 to {SUBJECT_ID_MAX_LENGTH} characters.", fields={"data.id": ["Bad length."]}
        )
    return {"id": subject}


@transaction.atomic
def emit_event(*, organization: Organization, event_type: str, data: dict) -> WebhookEvent | None:
    """Stores the event `event_type` about the object `data["id"]` and a delivery of it to each endpoint of
    the organization that subscribes to it, in the caller's transaction, so that the event exists exactly
    when what it reports does; each delivery's first try is a task sent once that transaction commits.
    An event is stored once per object: emitting it again changes nothing and answers the first. None when
    no endpoint subscribes."""
    check_event_types([event_type])
    data = _checked_data(data)
    endpoints = endpoints_subscribed(organization=organization, event_type=event_type)
    if not endpoints:
        return None
    event, created = WebhookEvent.objects.get_or_create(
        organization=organization, type=event_type, subject_id=data["id"], defaults={"data": data}
    )
    if not created:
        return event
    deliveries = WebhookDelivery.objects.bulk_create(
        WebhookDelivery(event=event, endpoint=endpoint, next_attempt_at=event.created_at) for endpoint in endpoints
    )
    for delivery in deliveries:
        # robust: a broker that is down fails no caller; resume_webhook_deliveries sends the task later.
        transaction.on_commit(lambda delivery_id=delivery.id: deliver_webhook.delay(delivery_id), robust=True)
    return event
