"""Files and batches: upload, create, cancel, and the state changes of a batch's run (runner.py drives them)."""

import hashlib
import hmac
import json
from dataclasses import dataclass
from datetime import datetime, timedelta

from django.conf import settings
from django.db import transaction
from django.db.models import Q
from django.utils import timezone

from controlplane.batches.jsonl import ENDPOINTS, parse_input_file
from controlplane.batches.models import (
    ACTIVE_BATCH_STATUSES,
    Batch,
    BatchLine,
    BatchStatus,
    File,
    FilePurpose,
    LineState,
    answer_usage,
    new_batch_id,
)
from controlplane.batches.selectors import file_get, lines_pending_count, lines_sent_unanswered_count
from controlplane.catalog.models import Model
from controlplane.common.errors import InvalidInput
from controlplane.common.tokens import token_from_secret
from controlplane.tenancy.api_keys import API_KEY_PREFIX
from controlplane.tenancy.models import ApiKeyKind, Organization, Scope
from controlplane.tenancy.services import api_key_create, api_key_revoke

COMPLETION_WINDOWS = {"24h": timedelta(hours=24)}
MAX_METADATA_PAIRS = 16
MAX_METADATA_KEY = 64
MAX_METADATA_VALUE = 512
MAX_FILENAME = 255


def runner_key_secret(batch_public_id: str) -> str:
    """The API key the runner sends a batch's lines with, derived from the control plane's secret so that it
    is never stored: only its hash is, like every key's."""
    secret = hmac.new(settings.SECRET_KEY.encode(), f"batch runner {batch_public_id}".encode(), hashlib.sha256)
    return token_from_secret(API_KEY_PREFIX, secret.digest())


# ---- files -----------------------------------------------------------------------------------------------


def file_upload(*, organization: Organization, filename: str, content: bytes, purpose: str) -> File:
    if purpose != FilePurpose.BATCH:
        raise InvalidInput(
            f"purpose is {purpose!r}; only 'batch' files can be uploaded here.", fields={"purpose": ["Use 'batch'."]}
        )
    limit = settings.DIPTYCH_BATCH_FILE_MAX_BYTES
    if len(content) > limit:
        raise InvalidInput(
            f"The file is {len(content)} bytes; a batch input file holds at most {limit} bytes: split it.",
            fields={"file": [f"At most {limit} bytes."]},
        )
    parsed = parse_input_file(content, max_lines=settings.DIPTYCH_BATCH_FILE_MAX_LINES)
    return File.objects.create(
        organization=organization,
        purpose=purpose,
        filename=(filename or "input.jsonl")[:MAX_FILENAME],
        content=content,
        bytes=len(content),
        line_count=len(parsed.lines),
        endpoint=parsed.endpoint,
    )


def file_delete(*, file: File) -> None:
    file.delete()


# ---- batches ---------------------------------------------------------------------------------------------


@transaction.atomic
def batch_create(
    *,
    organization: Organization,
    input_file_id: str,
    endpoint: str,
    completion_window: str,
    metadata: dict | None = None,
) -> Batch:
    if endpoint not in ENDPOINTS:
        raise InvalidInput(
            f"endpoint is {endpoint!r}; use one of {', '.join(ENDPOINTS)}.", fields={"endpoint": ["Unsupported."]}
        )
    if completion_window not in COMPLETION_WINDOWS:
        raise InvalidInput(
            f"completion_window is {completion_window!r}; only '24h' is supported.",
            fields={"completion_window": ["Use '24h'."]},
        )
    _check_metadata(metadata)
    file = file_get(organization=organization, public_id=input_file_id)
    if file.purpose != FilePurpose.BATCH:
        raise InvalidInput(
            f"input_file_id {input_file_id!r} is a {file.purpose} file; upload the requests with purpose 'batch'.",
            fields={"input_file_id": ["Not a batch input file."]},
        )
    lines = parse_input_file(bytes(file.content), max_lines=settings.DIPTYCH_BATCH_FILE_MAX_LINES).lines
    if file.endpoint != endpoint:
        raise InvalidInput(
            f"Invalid batch input file: line {lines[0].line_number}: url is {file.endpoint!r} but the batch's "
            f"endpoint is {endpoint!r}; create the batch with endpoint {file.endpoint!r} or fix the file.",
            fields={"input_file_id": [f"line {lines[0].line_number}: url does not match endpoint."]},
        )
    _check_models(lines)
    public_id = new_batch_id()
    now = timezone.now()
    expires_at = now + COMPLETION_WINDOWS[completion_window]
    runner_key = api_key_create(
        organization=organization,
        name=f"batch runner {public_id}"[:100],
        scopes=[Scope.INFERENCE],
        expires_at=expires_at + timedelta(seconds=settings.DIPTYCH_BATCH_LINE_TIMEOUT_SECONDS),
        key=runner_key_secret(public_id),
        kind=ApiKeyKind.BATCH_RUNNER,
    ).api_key
    batch = Batch.objects.create(
        public_id=public_id,
        organization=organization,
        endpoint=endpoint,
        completion_window=completion_window,
        input_file_id=file.public_id,
        metadata=metadata,
        runner_key=runner_key,
        created_at=now,
        expires_at=expires_at,
    )
    BatchLine.objects.bulk_create(
        BatchLine(batch=batch, line_number=line.line_number, custom_id=line.custom_id, body=line.body) for line in lines
    )
    transaction.on_commit(lambda: _schedule_run(batch.id))
    return batch


def _check_metadata(metadata: dict | None) -> None:
    if metadata is None:
        return
    problem = None
    if not isinstance(metadata, dict) or len(metadata) > MAX_METADATA_PAIRS:
        problem = f"must be an object of at most {MAX_METADATA_PAIRS} pairs"
    elif any(not isinstance(k, str) or len(k) > MAX_METADATA_KEY for k in metadata):
        problem = f"keys must be strings of at most {MAX_METADATA_KEY} characters"
    elif any(not isinstance(v, str) or len(v) > MAX_METADATA_VALUE for v in metadata.values()):
        problem = f"values must be strings of at most {MAX_METADATA_VALUE} characters"
    if problem:
        raise InvalidInput(f"metadata {problem}.", fields={"metadata": [problem]})


def _check_models(lines) -> None:
    """Every line names a model the catalog serves, so that a typo fails the create, not every request."""
    known = set(Model.objects.values_list("name", flat=True))
    for line in lines:
        model = line.body.get("model")
        if not isinstance(model, str) or model not in known:
            raise InvalidInput(
                f"Invalid batch input file: line {line.line_number}: body.model is {model!r}; "
                f"use one of {', '.join(sorted(known)) or 'the catalog models'}.",
                fields={"input_file_id": [f"line {line.line_number}: unknown model."]},
            )


def batch_cancel(*, batch: Batch) -> Batch:
    with transaction.atomic():
        batch = Batch.objects.select_for_update().get(pk=batch.pk)
        if batch.status in (BatchStatus.CANCELLING, BatchStatus.CANCELLED):
            return batch
        if batch.status not in (BatchStatus.VALIDATING, BatchStatus.IN_PROGRESS):
            raise InvalidInput(
                f"Batch {batch.public_id} is {batch.status}; only a validating or in-progress batch can be cancelled.",
                fields={"status": [batch.status]},
            )
        batch.status, batch.cancelling_at = BatchStatus.CANCELLING, timezone.now()
        batch.save(update_fields=["status", "cancelling_at"])
        transaction.on_commit(lambda: _schedule_run(batch.id))
    return batch


def _schedule_run(batch_id: int) -> None:
    from controlplane.batches.tasks import run_batch

    run_batch.delay(batch_id)


# ---- a run: the runner's lease, the lines' answers, the end -------------------------------------------------


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
    Batch.objects.filter(id=batch.id, status=BatchStatus.VALIDATING).update(
        status=BatchStatus.IN_PROGRESS, in_progress_at=timezone.now()
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
    error files and the final status. True when the batch has ended. A cancelled or expired batch first
    gets the answers of the lines it sent, so that a line that ran is reported with its answer."""
    batch.refresh_from_db()
    if batch.status == BatchStatus.CANCELLING or now >= batch.expires_at:
        if lines_sent_unanswered_count(batch=batch):
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
