from django.db import models
from django.utils import timezone

from controlplane.common.fields import JsonTextField
from controlplane.common.ids import PUBLIC_ID_MAX_LENGTH, new_public_id
from controlplane.tenancy.models import ApiKey, Organization


def new_file_id() -> str:
    return new_public_id("file")


def new_batch_id() -> str:
    return new_public_id("batch")


class FilePurpose(models.TextChoices):
    BATCH = "batch"  # an input file, uploaded by a client
    BATCH_OUTPUT = "batch_output"  # an output or error file, written by a batch


class File(models.Model):
    """A JSON Lines file of an organization: a batch's input, or a batch's output or errors."""

    public_id = models.CharField(max_length=PUBLIC_ID_MAX_LENGTH, unique=True, default=new_file_id, editable=False)
    organization = models.ForeignKey(Organization, on_delete=models.CASCADE, related_name="files")
    purpose = models.CharField(max_length=16, choices=FilePurpose.choices)
    filename = models.CharField(max_length=255)
    content = models.BinaryField()
    bytes = models.PositiveBigIntegerField()
    line_count = models.PositiveIntegerField()
    endpoint = models.CharField(max_length=64, blank=True, default="", help_text="The url every input line names.")
    created_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        indexes = [models.Index(fields=["organization", "-id"])]

    def __str__(self) -> str:
        return f"{self.filename} ({self.public_id})"


class BatchStatus(models.TextChoices):
    VALIDATING = "validating"
    IN_PROGRESS = "in_progress"
    FINALIZING = "finalizing"
    COMPLETED = "completed"
    FAILED = "failed"
    EXPIRED = "expired"
    CANCELLING = "cancelling"
    CANCELLED = "cancelled"


ACTIVE_BATCH_STATUSES = [
    BatchStatus.VALIDATING,
    BatchStatus.IN_PROGRESS,
    BatchStatus.FINALIZING,
    BatchStatus.CANCELLING,
]


class Batch(models.Model):
    """Requests of one input file, run in the background at batch priority and price."""

    public_id = models.CharField(max_length=PUBLIC_ID_MAX_LENGTH, unique=True, default=new_batch_id, editable=False)
    organization = models.ForeignKey(Organization, on_delete=models.CASCADE, related_name="batches")
    endpoint = models.CharField(max_length=64)
    completion_window = models.CharField(max_length=8)
    status = models.CharField(max_length=16, choices=BatchStatus.choices, default=BatchStatus.VALIDATING)
    input_file_id = models.CharField(max_length=PUBLIC_ID_MAX_LENGTH)
    output_file = models.ForeignKey(File, null=True, blank=True, on_delete=models.SET_NULL, related_name="+")
    error_file = models.ForeignKey(File, null=True, blank=True, on_delete=models.SET_NULL, related_name="+")
    metadata = models.JSONField(null=True, blank=True)
    errors = models.JSONField(null=True, blank=True)
    runner_key = models.OneToOneField(
        ApiKey, on_delete=models.PROTECT, related_name="batch", help_text="The key the batch runner sends lines with."
    )
    lease_holder = models.CharField(max_length=64, blank=True, default="", help_text="The runner holding the batch.")
    lease_until = models.DateTimeField(null=True, blank=True, help_text="It holds the batch until then.")
    created_at = models.DateTimeField(default=timezone.now)
    expires_at = models.DateTimeField(help_text="created_at plus the completion window, from the same clock reading.")
    in_progress_at = models.DateTimeField(null=True, blank=True)
    finalizing_at = models.DateTimeField(null=True, blank=True)
    completed_at = models.DateTimeField(null=True, blank=True)
    failed_at = models.DateTimeField(null=True, blank=True)
    expired_at = models.DateTimeField(null=True, blank=True)
    cancelling_at = models.DateTimeField(null=True, blank=True)
    cancelled_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        verbose_name_plural = "batches"
        indexes = [models.Index(fields=["organization", "-id"]), models.Index(fields=["status"])]

    def __str__(self) -> str:
        return f"{self.public_id} ({self.status})"


class LineState(models.TextChoices):
    PENDING = "pending"  # not answered yet (sent or not: `sent_at` tells; a line sent again replays its answer)
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    NOT_RUN = "not_run"  # the batch was cancelled or expired before the line was answered


class BatchLine(models.Model):
    """One request of a batch and its durable state: what survives a restart of the runner."""

    batch = models.ForeignKey(Batch, on_delete=models.CASCADE, related_name="lines")
    line_number = models.PositiveIntegerField()
    custom_id = models.CharField(max_length=512)
    body: dict = JsonTextField()
    state = models.CharField(max_length=16, choices=LineState.choices, default=LineState.PENDING)
    attempts = models.PositiveIntegerField(default=0)
    not_before = models.DateTimeField(null=True, blank=True, help_text="Retry no earlier than this.")
    sent_at = models.DateTimeField(
        null=True, blank=True, help_text="Sent, and the gateway may have run it: its answer is still to be had."
    )
    status_code = models.PositiveIntegerField(null=True, blank=True)
    request_id = models.CharField(max_length=128, blank=True, default="")
    response: dict | None = JsonTextField(null=True, blank=True)
    finished_at = models.DateTimeField(null=True, blank=True)
    # The usage of a succeeded line's answer, summed into its batch's usage.
    input_tokens = models.PositiveIntegerField(default=0)
    cached_tokens = models.PositiveIntegerField(default=0, help_text="Of the input tokens, those cached.")
    output_tokens = models.PositiveIntegerField(default=0)

    class Meta:
        constraints = [
            models.UniqueConstraint(fields=["batch", "custom_id"], name="batches_line_one_per_custom_id"),
            models.UniqueConstraint(fields=["batch", "line_number"], name="batches_line_one_per_number"),
        ]
        indexes = [models.Index(fields=["batch", "state"])]

    def __str__(self) -> str:
        return f"{self.batch.public_id}/{self.custom_id}"


def answer_usage(response: dict | None) -> dict[str, int]:
    """BatchLine's token counts of a gateway's answer: its OpenAI `usage` (none in an error's answer)."""
    usage = (response or {}).get("usage") or {}
    return {
        "input_tokens": usage.get("prompt_tokens", 0),
        "cached_tokens": (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0),
        "output_tokens": usage.get("completion_tokens", 0),
    }
