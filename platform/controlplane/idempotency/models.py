"""An idempotency key's record: the one execution it names, and its answer once it completed."""

from django.db import models

from controlplane.common.fields import JsonTextField
from controlplane.tenancy.models import Organization


class IdempotencyState(models.TextChoices):
    IN_FLIGHT = "in_flight"
    COMPLETED = "completed"


class IdempotencyRecord(models.Model):
    """An organization's idempotency key and the one execution it names.

    While the execution runs, the record is `in_flight` under a lease (so a gateway that died does not lock
    the key for ever); once it completed, the record holds the final response, which a retry with the same
    key and the same request gets back instead of a new execution.
    """

    organization = models.ForeignKey(Organization, on_delete=models.CASCADE, related_name="idempotency_records")
    key = models.CharField(max_length=255)
    fingerprint = models.CharField(max_length=64, help_text="Hash of the request the key was first used with.")
    execution_id = models.CharField(max_length=128)
    caller = models.CharField(
        max_length=160, default="", help_text="Who made the request and with what authority; only it gets the answer."
    )
    state = models.CharField(max_length=16, choices=IdempotencyState.choices)
    response: dict | None = JsonTextField(null=True, blank=True)
    lease_expires_at = models.DateTimeField()
    created_at = models.DateTimeField()
    completed_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        db_table = "metering_idempotencyrecord"  # the table the metering app made, kept where it is
        constraints = [
            models.UniqueConstraint(fields=["organization", "key"], name="metering_idempotency_one_per_key"),
        ]
        indexes = [models.Index(fields=["created_at"], name="metering_id_created_6fbc44_idx")]

    def __str__(self) -> str:
        return f"{self.organization_id}/{self.key}"
