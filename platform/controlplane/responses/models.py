from django.db import models

from controlplane.common.fields import JsonTextField
from controlplane.tenancy.models import ApiKey, Organization

RESPONSE_ID_MAX_LENGTH = 64


class ResponseStatus(models.TextChoices):
    QUEUED = "queued"
    IN_PROGRESS = "in_progress"
    COMPLETED = "completed"
    INCOMPLETE = "incomplete"
    FAILED = "failed"
    CANCELLED = "cancelled"


ACTIVE_STATUSES = (ResponseStatus.QUEUED, ResponseStatus.IN_PROGRESS)


class StoredResponse(models.Model):
    """A response of `/v1/responses` that its request asked to store, as the gateway ran it: the request's
    options, its input and output items, its usage, and the token ids of its conversation (the prompt it ran
    on and the output as generated), so that a response continuing it runs on them extended. Its id is the
    gateway's (`resp_...`, named after the execution); it is deleted once it expires."""

    public_id = models.CharField(max_length=RESPONSE_ID_MAX_LENGTH, unique=True, editable=False)
    organization = models.ForeignKey(Organization, on_delete=models.CASCADE, related_name="stored_responses")
    api_key = models.ForeignKey(ApiKey, null=True, on_delete=models.SET_NULL, related_name="+")
    model = models.CharField(max_length=200)
    status = models.CharField(max_length=16, choices=ResponseStatus.choices)
    background = models.BooleanField(default=False)
    request: dict = JsonTextField(help_text="The request's options, as the Response object echoes them.")
    metadata: dict = JsonTextField()
    context_items: list = JsonTextField(help_text="The conversation before this response's input.")
    input_items: list = JsonTextField()
    output_items: list = JsonTextField()
    usage: dict | None = JsonTextField(null=True)
    error: dict | None = JsonTextField(null=True)
    incomplete_details: dict | None = JsonTextField(null=True)
    prompt_token_ids = models.BinaryField(help_text="Little-endian uint32s.")
    output_token_ids = models.BinaryField(help_text="Little-endian uint32s, as generated.")
    created_at = models.DateTimeField()
    completed_at = models.DateTimeField(null=True, blank=True)
    expires_at = models.DateTimeField(help_text="created_at plus the retention (DIPTYCH_RESPONSE_RETENTION_DAYS).")
    size_bytes = models.PositiveBigIntegerField(help_text="What it takes to store: its items, options and token ids.")

    class Meta:
        indexes = [models.Index(fields=["organization", "-id"]), models.Index(fields=["expires_at"])]

    def __str__(self) -> str:
        return f"{self.public_id} ({self.status})"
