from django.db import models
from django.db.models import F, Q

from controlplane.catalog.models import PriceTier
from controlplane.tenancy.models import ApiKey, Organization, Project


class Phase(models.TextChoices):
    PREFILL = "prefill"
    DECODE = "decode"


class UsageEvent(models.Model):
    """Append-only ledger of the work done for one execution in one phase, as reported by the gateway.

    `request_id` is the execution's server-issued id (`exec_` and 32 hex digits), unique per execution;
    a client's own label for the request is kept in `client_request_id` and never decides what is billed.
    """

    request_id = models.CharField(max_length=128)
    client_request_id = models.CharField(max_length=128, blank=True, default="")
    phase = models.CharField(max_length=16, choices=Phase.choices)
    organization = models.ForeignKey(Organization, on_delete=models.PROTECT, related_name="usage_events")
    api_key = models.ForeignKey(ApiKey, on_delete=models.PROTECT, related_name="usage_events")
    project = models.ForeignKey(
        Project, on_delete=models.PROTECT, related_name="usage_events", help_text="The key's project at ingest."
    )
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
    tier = models.CharField(
        max_length=16, choices=PriceTier.choices, default=PriceTier.STANDARD, help_text="batch: a Batch API request."
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
            models.Index(fields=["organization", "client_request_id"]),
            models.Index(fields=["project", "-started_at"]),
        ]

    def __str__(self) -> str:
        return f"{self.request_id}/{self.phase}"


class RefusalScope(models.TextChoices):
    ORGANIZATION = "organization"
    PROJECT = "project"
    API_KEY = "api_key"


class RefusedLimit(models.TextChoices):
    REQUESTS_PER_MINUTE = "requests_per_minute"
    INPUT_TOKENS_PER_MINUTE = "input_tokens_per_minute"
    OUTPUT_TOKENS_PER_MINUTE = "output_tokens_per_minute"


class RateLimitRefusal(models.Model):
    """Requests a gateway refused (429) in one minute, for one API key, by one limit, as it reported them.

    Each gateway counts its refusals per minute in memory and reports them in batches; `report_id` is the
    gateway's id for the row, so that a batch sent again after a lost answer counts once.
    """

    report_id = models.CharField(max_length=64, unique=True)
    organization = models.ForeignKey(Organization, on_delete=models.CASCADE, related_name="+")
    api_key = models.ForeignKey(ApiKey, on_delete=models.CASCADE, related_name="+")
    scope = models.CharField(max_length=16, choices=RefusalScope.choices, help_text="Whose limit refused.")
    limit = models.CharField(max_length=32, choices=RefusedLimit.choices)
    limit_value = models.PositiveBigIntegerField(help_text="The limit per minute when it refused.")
    minute = models.DateTimeField(help_text="The minute (UTC) the requests were refused in.")
    refusals = models.PositiveIntegerField()
    ingested_at = models.DateTimeField()

    class Meta:
        indexes = [models.Index(fields=["organization", "-minute"])]

    def __str__(self) -> str:
        return f"{self.api_key_id} {self.scope} {self.limit} at {self.minute:%Y-%m-%d %H:%M}: {self.refusals}"
