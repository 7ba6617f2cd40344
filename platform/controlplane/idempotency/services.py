"""Idempotency keys, kept for every caller that runs work under one: the gateway's executions (through the
internal API) and the control plane's own POSTs (`controlplane.common.idempotency`). A key belongs to an
organization and names one execution; its record holds that execution's final response once it completed."""

from dataclasses import dataclass
from datetime import datetime, timedelta

from django.db import IntegrityError, transaction
from django.utils import timezone

from controlplane.common.errors import InvalidInput
from controlplane.idempotency.models import IdempotencyRecord, IdempotencyState
from controlplane.tenancy.models import Organization

IDEMPOTENCY_KEY_RETENTION = timedelta(hours=24)


@dataclass(frozen=True)
class IdempotencyClaim:
    """What a request with an idempotency key may do.

    outcome: `claimed` (run it as `execution_id`), `in_flight` (another execution with this key is
    running: refuse with a conflict), `completed` (return `response`, the stored result of
    `execution_id`, without running anything), `mismatch` (the key was used with another request) or
    `other_caller` (the key was used by another caller: nothing about its request is told).
    """

    outcome: str
    execution_id: str
    response: dict | None = None


@transaction.atomic
def idempotency_key_claim(
    *, organization_id: str, key: str, caller: str, fingerprint: str, execution_id: str, lease: timedelta
) -> IdempotencyClaim:
    """`caller` names who asks and with what authority (an API key and its scopes, a member and its role):
    a stored answer, or even the news that the key is taken, goes only to the caller that claimed it."""
    organization = _organization(organization_id)
    now = timezone.now()
    record = _locked_record(organization, key)
    if record is None:
        try:
            with transaction.atomic():
                IdempotencyRecord.objects.create(
                    organization=organization,
                    key=key,
                    caller=caller,
                    fingerprint=fingerprint,
                    execution_id=execution_id,
                    state=IdempotencyState.IN_FLIGHT,
                    lease_expires_at=now + lease,
                    created_at=now,
                )
            return IdempotencyClaim("claimed", execution_id)
        except IntegrityError:  # a concurrent claim of the same key created it first
            record = IdempotencyRecord.objects.select_for_update().get(organization=organization, key=key)
    if _expired(record, now):
        record.caller = caller  # an expired record: the key starts over, for whoever claims it now
        _take_over(record, fingerprint=fingerprint, execution_id=execution_id, now=now, lease=lease, fresh=True)
        return IdempotencyClaim("claimed", execution_id)
    if record.caller != caller:
        return IdempotencyClaim("other_caller", "")
    if record.fingerprint != fingerprint:
        return IdempotencyClaim("mismatch", record.execution_id)
    if record.state == IdempotencyState.COMPLETED:
        return IdempotencyClaim("completed", record.execution_id, record.response)
    if record.execution_id == execution_id:  # its own claim again: the answer to the first one was lost
        return IdempotencyClaim("claimed", execution_id)
    if record.lease_expires_at > now:
        return IdempotencyClaim("in_flight", record.execution_id)
    # The execution holding the key outlived its lease (its gateway died): it was billed for what it
    # delivered, and this request becomes a new execution under the key.
    _take_over(record, fingerprint=fingerprint, execution_id=execution_id, now=now, lease=lease, fresh=False)
    return IdempotencyClaim("claimed", execution_id)


def _locked_record(organization: Organization, key: str) -> IdempotencyRecord | None:
    return IdempotencyRecord.objects.select_for_update().filter(organization=organization, key=key).first()


def _take_over(
    record: IdempotencyRecord, *, fingerprint: str, execution_id: str, now: datetime, lease: timedelta, fresh: bool
) -> None:
    record.execution_id, record.lease_expires_at = execution_id, now + lease
    if fresh:  # an expired record: the key starts over
        record.fingerprint, record.state, record.response = fingerprint, IdempotencyState.IN_FLIGHT, None
        record.created_at, record.completed_at = now, None
    record.save()


@transaction.atomic
def idempotency_key_complete(*, organization_id: str, key: str, execution_id: str, response: dict) -> bool:
    """Stores the final response of the execution that holds the key; False when it no longer holds it."""
    updated = IdempotencyRecord.objects.filter(
        organization=_organization(organization_id),
        key=key,
        execution_id=execution_id,
        state=IdempotencyState.IN_FLIGHT,
    ).update(state=IdempotencyState.COMPLETED, response=response, completed_at=timezone.now())
    return updated == 1


@transaction.atomic
def idempotency_key_release(*, organization_id: str, key: str, execution_id: str) -> bool:
    """Frees the key after its execution failed or was cancelled, so that a retry runs (and is billed) anew."""
    deleted, _ = IdempotencyRecord.objects.filter(
        organization=_organization(organization_id),
        key=key,
        execution_id=execution_id,
        state=IdempotencyState.IN_FLIGHT,
    ).delete()
    return deleted == 1


def idempotency_records_purge(*, now: datetime | None = None) -> int:
    """Deletes records older than the retention; run daily."""
    cutoff = (now or timezone.now()) - IDEMPOTENCY_KEY_RETENTION
    deleted, _ = IdempotencyRecord.objects.filter(created_at__lt=cutoff).delete()
    return deleted


def _expired(record: IdempotencyRecord, now: datetime) -> bool:
    return record.created_at < now - IDEMPOTENCY_KEY_RETENTION


def _organization(public_id: str) -> Organization:
    organization = Organization.objects.filter(public_id=public_id).first()
    if organization is None:
        raise InvalidInput(
            f"Unknown organization {public_id!r}.", fields={"organization_id": ["Unknown organization."]}
        )
    return organization
