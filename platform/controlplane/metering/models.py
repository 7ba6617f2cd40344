from django.db import models
from django.db.models import F, Q

from controlplane.tenancy.models import ApiKey, Organization


class Phase(models.TextChoices):
    PREFILL = "prefill"
    DECODE = "decode"


class UsageEvent(models.Model):
    """Append-only ledger of the work done for one request in one phase, as reported by the gateway."""

    request_id = models.CharField(max_length=128)
    phase = models.CharField(max_length=16, choices=Phase.choices)
    organization = models.ForeignKey(Organization, on_delete=models.PROTECT, related_name="usage_events")
    api_key = models.ForeignKey(ApiKey, on_delete=models.PROTECT, related_name="usage_events")
    model = models.CharField(max_length=200, help_text="The model name as served.")
    region = models.CharField(max_length=64)
    worker_id = models.CharField(max_length=64)
    tokens = models.PositiveBigIntegerField()
    cached_tokens = models.PositiveBigIntegerField(help_text="Tokens served from the prefix cache.")
    kv_bytes = models.PositiveBigIntegerField()
    compute_ms = models.PositiveBigIntegerField()
    started_at = models.DateTimeField()
    finished_at = models.DateTimeField()
    ingested_at = models.DateTimeField()
    period_start = models.DateField(
        help_text="First day of the billing period the event is billed in (see billing.periods for late events)."
    )

    class Meta:
        constraints = [
            models.UniqueConstraint(fields=["request_id", "phase"], name="metering_usageevent_one_per_request_phase"),
            models.CheckConstraint(
                condition=Q(cached_tokens__lte=F("tokens")), name="metering_usageevent_cached_within_tokens"
            ),
            models.CheckConstraint(
                condition=Q(started_at__lte=F("finished_at")), name="metering_usageevent_starts_before_finish"
            ),
        ]
        indexes = [
            models.Index(fields=["organization", "-started_at"]),
            models.Index(fields=["ingested_at"]),
            models.Index(fields=["organization", "period_start"]),
        ]

    def __str__(self) -> str:
        return f"{self.request_id}/{self.phase}"
