from datetime import datetime, timedelta

from django.db.models import Q, QuerySet

from controlplane.common.errors import ObjectNotFound
from controlplane.tenancy.models import Organization
from controlplane.tenancy.scoping import organization_rows
from controlplane.webhooks.models import DeliveryStatus, WebhookDelivery, WebhookEndpoint


def endpoint_list(*, organization: Organization) -> QuerySet[WebhookEndpoint]:
    return organization_rows(WebhookEndpoint, organization=organization).order_by("-id")


def endpoint_get(*, organization: Organization, public_id: str) -> WebhookEndpoint:
    endpoint = endpoint_list(organization=organization).filter(public_id=public_id).first()
    if endpoint is None:
        raise ObjectNotFound(f"No webhook endpoint with id {public_id!r}.")
    return endpoint


def endpoints_subscribed(*, organization: Organization, event_type: str) -> list[WebhookEndpoint]:
    # Filtered here, not by the database: SQLite has no JSON containment, and an organization has few endpoints.
    return [endpoint for endpoint in endpoint_list(organization=organization) if event_type in endpoint.event_types]


def delivery_list(*, endpoint: WebhookEndpoint) -> QuerySet[WebhookDelivery]:
    deliveries = WebhookDelivery.objects.filter(endpoint=endpoint).select_related("event")
    return deliveries.prefetch_related("attempt_log").order_by("-id")


def delivery_ids_overdue(*, now: datetime, grace: timedelta) -> list[int]:
    """Pending deliveries whose try is `grace` late and held by no try: their task was lost or never sent."""
    overdue = WebhookDelivery.objects.filter(status=DeliveryStatus.PENDING, next_attempt_at__lt=now - grace)
    free = overdue.filter(Q(lease_until__isnull=True) | Q(lease_until__lt=now))
    return list(free.order_by("next_attempt_at").values_list("id", flat=True)[:1000])
