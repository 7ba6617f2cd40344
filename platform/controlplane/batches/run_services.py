"""The state changes of a batch's run, which the runner (runner.py) drives: the runner's lease on the batch,
its start, each line's answer or postponement, and its end with the output and error files. Below the
services that create and cancel a batch (services.py): nothing here starts a run."""

import hashlib
import hmac
import json
from dataclasses import dataclass
from datetime import datetime, timedelta

from django.conf import settings
from django.db import transaction
from django.db.models import Q
from django.utils import timezone

from controlplane.batches.models import (
    ACTIVE_BATCH_STATUSES,
    Batch,
    BatchLine,
    BatchStatus,
    File,
    FilePurpose,
    LineState,
    answer_usage,
)
from controlplane.batches.selectors import lines_naming_unknown_models, lines_pending_count, lines_sent_unanswered_count
from controlplane.common.tokens import token_from_secret
from controlplane.tenancy.api_keys import API_KEY_PREFIX
from controlplane.tenancy.services import api_key_revoke
from controlplane.webhooks.models import EventType
from controlplane.webhooks.services import emit_event

# The webhook event of each status a batch ends in.
END_EVENTS = {
    BatchStatus.COMPLETED: EventType.BATCH_COMPLETED,
    BatchStatus.FAILED: EventType.BATCH_FAILED,
    BatchStatus.EXPIRED: EventType.BATCH_EXPIRED,
    BatchStatus.CANCELLED: EventType.BATCH_CANCELLED,
}


def runner_key_secret(batch_public_id: str) -> str:
    """The API key the runner sends a batch's lines with, derived from the control plane's secret so that it
    is never stored: only its hash is, like every key's."""
    secret = hmac.new(settings.SECRET_KEY.encode(), f"batch runner {batch_public_id}".encode(), hashlib.sha256)
    return token_from_secret(API_KEY_PREFIX, secret.digest())


def batch_lease_claim(*, batch_id: int, holder: str, now: datetime) -> Batch | None:
    """The batch, held by `holder` for a lease, if it is active and free (or already `holder`'s)."""
    lease_until = now + timedelta(seconds=settings.DIPTYCH_BATCH_LEASE_SECONDS)
    free = Q(lease_until__isnull=True) | Q(lease_until__lt=now) | Q(lease_holder=holder)
    claimed = Batch.objects.filter(free, id=batch_id, status__in=ACTIVE_BATCH_STATUSES).update(
        lease_holder=holder, lease_until=lease_until
    )
    return Batch.objects.filter(id=batch_id).first() if claimed else None


def batch_lease_renew(*, batch: Batch, holder: str) -> None:
    lease_until = timezone.now() + timedelta(seconds=settings.DIPTYCH_BATCH_LEASE_SECONDS)
    Batch.objects.filter(id=batch.id, lease_holder=holder).update(lease_until=lease_until)


def batch_lease_release(*, batch: Batch, holder: str) -> None:
    Batch.objects.filter(id=batch.id, lease_holder=holder).update(lease_holder="", lease_until=None)


def batch_start(*, batch: Batch) -> Batch:
    """A validating batch goes in progress, or fails when its lines no longer pass the checks of its create:
    a model may have left the catalog since (a batch waits for a runner up to its whole window)."""
    errors = _input_errors(batch)
    if errors:
        return batch_fail(batch=batch, errors=errors)
    Batch.objects.filter(id=batch.id, status=BatchStatus.VALIDATING).update(
        status=BatchStatus.IN_PROGRESS, in_progress_at=timezone.now()
    )
    batch.refresh_from_db()
    return batch


def _input_errors(batch: Batch) -> list[dict]:
    return [
        {
            "code": "invalid_model",
            "message": f"line {line_number}: body.model {model!r} is not in the catalog.",
            "param": "body.model",
            "line": line_number,
        }
        for line_number, model in lines_naming_unknown_models(batch=batch)
    ]


def batch_fail(*, batch: Batch, errors: list[dict]) -> Batch:
    """Ends a validating batch as failed, none of its lines sent: its errors name each bad line (OpenAI's
    `errors` list); no output or error file; the runner key is revoked and batch.failed emitted."""
    now = timezone.now()
    with transaction.atomic():
        ended = Batch.objects.filter(id=batch.id, status=BatchStatus.VALIDATING).update(
            status=BatchStatus.FAILED,
            failed_at=now,
            errors={"object": "list", "data": errors},
            lease_holder="",
            lease_until=None,
        )
        if ended:
            BatchLine.objects.filter(batch=batch, state=LineState.PENDING).update(
                state=LineState.NOT_RUN, finished_at=now
            )
            api_key_revoke(api_key=batch.runner_key)
            emit_event(
                organization=batch.organization, event_type=END_EVENTS[BatchStatus.FAILED], data={"id": batch.public_id}
            )
    batch.refresh_from_db()
    return batch


@dataclass(frozen=True)
class LineAnswer:
    """What the gateway answered to one line: an HTTP status and JSON body, or no answer at all."""

    status_code: int | None  # None: the gateway could not be reached
    body: dict | None
    request_id: str = ""
    retry_after_s: float | None = None


def line_answered(*, line: BatchLine, answer: LineAnswer) -> None:
    """A final answer: the line succeeded (200) or failed (a refusal that a retry would get again)."""
    line.state = LineState.SUCCEEDED if answer.status_code == 200 else LineState.FAILED
    line.status_code = answer.status_code
    line.response = answer.body
    line.request_id = answer.request_id
    line.finished_at = timezone.now()
    usage = answer_usage(answer.body if line.state == LineState.SUCCEEDED else None)
    for name, tokens in usage.items():
        setattr(line, name, tokens)
    line.save(update_fields=["state", "status_code", "response", "request_id", "finished_at", *usage])


def line_sending(*, line: BatchLine) -> None:
    """Recorded before the line leaves, so that a runner started after a crash knows the gateway may have
    run it (and billed it) and fetches its answer instead of reporting it as never run."""
    line.sent_at = timezone.now()
    line.save(update_fields=["sent_at"])


def line_postponed(*, line: BatchLine, not_before: datetime, counted: bool, may_have_run: bool) -> None:
    """The line gets sent again after `not_before`; `counted` retries count towards its limit. Unless it
    `may_have_run` (no answer came, or it still runs), the gateway refused it: it counts as not sent."""
    line.not_before = not_before
    line.attempts += 1 if counted else 0
    line.sent_at = line.sent_at if may_have_run else None
    line.save(update_fields=["not_before", "attempts", "sent_at"])


def batch_finish_if_done(*, batch: Batch, now: datetime) -> bool:
    """Ends the batch when nothing is left to run or it was cancelled or expired: writes the output and
    error files and the final status, and emits the webhook event of that status. True when the batch has
    ended. A cancelled or expired batch first gets the answers of the lines it sent, so that a line that
    ran is reported with its answer."""
    batch.refresh_from_db()
    ending = batch.status == BatchStatus.CANCELLING or now >= batch.expires_at
    if ending and lines_sent_unanswered_count(batch=batch):
        return False
    if batch.status == BatchStatus.CANCELLING:
        final, reason = BatchStatus.CANCELLED, "batch_cancelled"
    elif now >= batch.expires_at:
        final, reason = BatchStatus.EXPIRED, "batch_expired"
    elif lines_pending_count(batch=batch) == 0:
        final, reason = BatchStatus.COMPLETED, ""
    else:
        return False
    if final == BatchStatus.COMPLETED:
        Batch.objects.filter(id=batch.id).update(status=BatchStatus.FINALIZING, finalizing_at=now)
    with transaction.atomic():
        BatchLine.objects.filter(batch=batch, state=LineState.PENDING).update(state=LineState.NOT_RUN, finished_at=now)
        api_key_revoke(api_key=batch.runner_key)  # every line has its answer: the key has nothing left to send
        output, errors = _result_files(batch, reason)
        Batch.objects.filter(id=batch.id).update(
            status=final,
            output_file=output,
            error_file=errors,
            lease_holder="",
            lease_until=None,
            **{f"{final}_at": timezone.now()},
        )
        # Stored with the end it reports, and sent once that commits.
        emit_event(organization=batch.organization, event_type=END_EVENTS[final], data={"id": batch.public_id})
    return True


def _result_files(batch: Batch, reason: str) -> tuple[File | None, File | None]:
    succeeded: list[bytes] = []
    failed: list[bytes] = []
    for line in BatchLine.objects.filter(batch=batch).order_by("line_number"):
        record = json.dumps(_result_record(batch, line, reason), separators=(",", ":")).encode()
        (succeeded if line.state == LineState.SUCCEEDED else failed).append(record)
    return _output_file(batch, "output", succeeded), _output_file(batch, "errors", failed)


def _result_record(batch: Batch, line: BatchLine, reason: str) -> dict:
    record: dict = {
        "id": f"batch_req_{batch.public_id.partition('_')[2]}_{line.line_number}",
        "custom_id": line.custom_id,
    }
    if line.state == LineState.NOT_RUN:
        message = "the batch was cancelled" if reason == "batch_cancelled" else "the batch expired"
        return {**record, "response": None, "error": {"code": reason, "message": f"{message} before this request ran"}}
    if line.status_code is None:
        error = {"code": "gateway_unavailable", "message": "the gateway could not be reached; the request did not run"}
        return {**record, "response": None, "error": error}
    response = {"status_code": line.status_code, "request_id": line.request_id, "body": line.response}
    return {**record, "response": response, "error": None}


def _output_file(batch: Batch, kind: str, records: list[bytes]) -> File | None:
    if not records:
        return None
    content = b"".join(record + b"\n" for record in records)
    return File.objects.create(
        organization_id=batch.organization_id,
        purpose=FilePurpose.BATCH_OUTPUT,
        filename=f"{batch.public_id}_{kind}.jsonl",
        content=content,
        bytes=len(content),
        line_count=len(records),
        endpoint=batch.endpoint,
    )
