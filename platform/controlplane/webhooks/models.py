from django.db import models
from django.utils import timezone

from controlplane.common.fields import JsonTextField
from controlplane.common.ids import PUBLIC_ID_MAX_LENGTH, new_public_id
from controlplane.tenancy.models import Organization

URL_MAX_LENGTH = 2048
SECRET_MAX_LENGTH = 64


def new_endpoint_id() -> str:
    return new_public_id("wh")


def new_event_id() -> str:
    return new_public_id("evt")


def new_delivery_id() -> str:
    return new_public_id("whd")


class EventType(models.TextChoices):
    """The events an endpoint subscribes to, named and shaped as OpenAI's webhook events."""

    BATCH_COMPLETED = "batch.completed"
    BATCH_FAILED = "batch.failed"
    BATCH_EXPIRED = "batch.expired"
    BATCH_CANCELLED = "batch.cancelled"
    RESPONSE_COMPLETED = "response.completed"
    RESPONSE_FAILED = "response.failed"
    RESPONSE_CANCELLED = "response.cancelled"


class WebhookEndpoint(models.Model):
    """A URL of an organization's that receives the events it subscribes to, signed with its secret."""

    public_id = models.CharField(max_length=PUBLIC_ID_MAX_LENGTH, unique=True, default=new_endpoint_id, editable=False)
    organization = models.ForeignKey(Organization, on_delete=models.CASCADE, related_name="webhook_endpoints")
    name = models.CharField(max_length=100, blank=True, default="")
    url = models.CharField(max_length=URL_MAX_LENGTH)
    event_types = models.JSONField(default=list, help_text="The EventType values it receives.")
    secret = models.CharField(max_length=SECRET_MAX_LENGTH, help_text="whsec_<base64>: signs every delivery.")
    previous_secret = models.CharField(max_length=SECRET_MAX_LENGTH, blank=True, default="")
    previous_secret_until = models.DateTimeField(
        null=True, blank=True, help_text="The secret before the last rotation signs too until then."
    )
    created_at = models.DateTimeField(default=timezone.now)
    updated_at = models.DateTimeField(default=timezone.now)

    class Meta:
        indexes = [models.Index(fields=["organization", "-id"])]

    def __str__(self) -> str:
        return f"{self.url} ({self.public_id})"


class WebhookEvent(models.Model):
    """Something that happened to an organization's object, once: the body every delivery of it sends."""

    public_id = models.CharField(max_length=PUBLIC_ID_MAX_LENGTH, unique=True, default=new_event_id, editable=False)
    organization = models.ForeignKey(Organization, on_delete=models.CASCADE, related_name="webhook_events")
    type = models.CharField(max_length=32, choices=EventType.choices)
    subject_id = models.CharField(max_length=64, help_text="data.id: the batch or response the event is about.")
    data: dict = JsonTextField()
    created_at = models.DateTimeField(default=timezone.now)

    class Meta:
        constraints = [
            models.UniqueConstraint(
                fields=["organization", "type", "subject_id"], name="webhooks_event_once_per_subject"
            )
        ]

    def __str__(self) -> str:
        return f"{self.type} {self.subject_id} ({self.public_id})"


class DeliveryStatus(models.TextChoices):
    PENDING = "pending"  # a try is due at next_attempt_at
    DELIVERED = "delivered"  # a try was answered 2xx
    FAILED = "failed"  # every try failed, or the destination is refused


class WebhookDelivery(models.Model):
    """One event on its way to one endpoint: its tries, made until one is answered 2xx or none is left."""

    public_id = models.CharField(max_length=PUBLIC_ID_MAX_LENGTH, unique=True, default=new_delivery_id, editable=False)
    event = models.ForeignKey(WebhookEvent, on_delete=models.CASCADE, related_name="deliveries")
    endpoint = models.ForeignKey(WebhookEndpoint, on_delete=models.CASCADE, related_name="deliveries")
    status = models.CharField(max_length=16, choices=DeliveryStatus.choices, default=DeliveryStatus.PENDING)
    attempts = models.PositiveIntegerField(default=0, help_text="Tries made so far.")
    next_attempt_at = models.DateTimeField(null=True, blank=True, help_text="When a pending delivery is tried next.")
    lease_until = models.DateTimeField(null=True, blank=True, help_text="A try holds the delivery until then.")
    delivered_at = models.DateTimeField(null=True, blank=True)
    created_at = models.DateTimeField(default=timezone.now)

    class Meta:
        verbose_name_plural = "webhook deliveries"
        constraints = [models.UniqueConstraint(fields=["event", "endpoint"], name="webhooks_delivery_one_per_endpoint")]
        indexes = [models.Index(fields=["endpoint", "-id"]), models.Index(fields=["status", "next_attempt_at"])]

    def __str__(self) -> str:
        return f"{self.public_id} ({self.status})"


class WebhookAttempt(models.Model):
    """One try of a delivery: what the endpoint answered (or why nothing did), and how long it took."""

    delivery = models.ForeignKey(WebhookDelivery, on_delete=models.CASCADE, related_name="attempt_log")
    number = models.PositiveIntegerField()
    started_at = models.DateTimeField()
    duration_ms = models.PositiveIntegerField()
    status_code = models.PositiveIntegerField(null=True, blank=True, help_text="Null: no HTTP answer.")
    error = models.CharField(max_length=500, blank=True, default="")

    class Meta:
        ordering = ["number"]
        constraints = [models.UniqueConstraint(fields=["delivery", "number"], name="webhooks_attempt_number_once")]

    def __str__(self) -> str:
        return f"{self.delivery.public_id} try {self.number}"
