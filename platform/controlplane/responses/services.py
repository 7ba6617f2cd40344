"""Stored responses: kept as the gateway stores them (created, then updated as a background one runs),
cancelled, deleted, and purged once they expire. A background response that ends is an event for the
organization's webhooks (response.completed, response.failed, response.cancelled), in the same transaction."""

import json
from dataclasses import asdict, dataclass
from datetime import datetime, timedelta

from django.conf import settings
from django.db import transaction

from controlplane.common.errors import InvalidInput
from controlplane.responses.models import ACTIVE_STATUSES, ResponseStatus, StoredResponse
from controlplane.tenancy.models import ApiKey, Organization
from controlplane.webhooks.models import EventType
from controlplane.webhooks.services import emit_event

ENDED_EVENTS = {
    ResponseStatus.COMPLETED: EventType.RESPONSE_COMPLETED,
    ResponseStatus.FAILED: EventType.RESPONSE_FAILED,
    ResponseStatus.CANCELLED: EventType.RESPONSE_CANCELLED,
}


@dataclass(frozen=True)
class ResponseContent:
    """What the gateway stores of a response, each time it stores it."""

    status: str
    model: str
    background: bool
    request: dict
    metadata: dict
    context_items: list
    input_items: list
    output_items: list
    usage: dict | None
    error: dict | None
    incomplete_details: dict | None
    prompt_token_ids: bytes
    output_token_ids: bytes
    created_at: datetime
    completed_at: datetime | None


def response_store(
    *, organization: Organization, api_key_id: str, public_id: str, content: ResponseContent, create: bool = True
) -> StoredResponse | None:
    """Creates the response or updates it. A cancelled response stays cancelled (its output is still taken: what
    it produced before the gateway running it saw the cancel), and an ended one never goes back to running.
    Without `create`, a response that is not stored (deleted meanwhile) stays so: None."""
    with transaction.atomic():
        row = StoredResponse.objects.select_for_update().filter(public_id=public_id).first()
        if row is not None and row.organization_id != organization.id:
            raise InvalidInput(f"Response id {public_id!r} is taken.", fields={"id": ["Taken."]})
        if row is None and not create:
            return None
        before = row.status if row is not None else None
        row = row or _new(organization, api_key_id, public_id, content.created_at)
        for name, value in asdict(content).items():
            if name != "created_at":
                setattr(row, name, value)
        if _keeps_status(before, row.status):
            row.status = before
        row.size_bytes = stored_size(row)
        row.save()
        if row.background and row.status != before and row.status in ENDED_EVENTS:
            emit_event(organization=organization, event_type=ENDED_EVENTS[row.status], data={"id": public_id})
    return row


def _keeps_status(before: str | None, after: str) -> bool:
    """A cancel stays, and an ended response does not go back to queued or in progress."""
    ended_before = before is not None and before not in ACTIVE_STATUSES
    return before == ResponseStatus.CANCELLED or (ended_before and after in ACTIVE_STATUSES)


def _new(organization: Organization, api_key_id: str, public_id: str, created_at: datetime) -> StoredResponse:
    retention = timedelta(days=settings.DIPTYCH_RESPONSE_RETENTION_DAYS)
    return StoredResponse(
        public_id=public_id,
        organization=organization,
        api_key=ApiKey.objects.filter(organization=organization, public_id=api_key_id).first(),
        created_at=created_at,
        expires_at=created_at + retention,
    )


def stored_size(row: StoredResponse) -> int:
    """The bytes a response takes: its JSON fields as stored, and its token ids."""
    texts = (row.request, row.metadata, row.context_items, row.input_items, row.output_items, row.usage, row.error)
    json_bytes = sum(len(json.dumps(value, separators=(",", ":")).encode()) for value in texts)
    return json_bytes + len(row.prompt_token_ids) + len(row.output_token_ids)


def response_cancel(*, response: StoredResponse) -> StoredResponse:
    """A background response still queued or running is cancelled; one already cancelled is as it was."""
    with transaction.atomic():
        row = StoredResponse.objects.select_for_update().get(pk=response.pk)
        if row.status == ResponseStatus.CANCELLED:
            return row
        if not row.background:
            raise InvalidInput(
                f"Response {row.public_id} did not run in the background; only background responses can be cancelled.",
                fields={"background": ["false"]},
            )
        if row.status not in ACTIVE_STATUSES:
            raise InvalidInput(
                f"Response {row.public_id} is {row.status}; only a queued or in-progress response can be cancelled.",
                fields={"status": [row.status]},
            )
        row.status = ResponseStatus.CANCELLED
        row.save(update_fields=["status"])
        emit_event(organization=row.organization, event_type=EventType.RESPONSE_CANCELLED, data={"id": row.public_id})
    return row


def response_delete(*, response: StoredResponse) -> None:
    response.delete()


def responses_purge_expired(*, now: datetime) -> int:
    deleted, _ = StoredResponse.objects.filter(expires_at__lte=now).delete()
    return deleted
