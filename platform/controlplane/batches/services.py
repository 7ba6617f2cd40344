"""Files and batches: upload, create, cancel; a batch created or cancelled is handed to a run (tasks.py), whose
state changes are run_services.py's."""

from datetime import timedelta

from django.conf import settings
from django.db import transaction
from django.utils import timezone

from controlplane.batches.jsonl import ENDPOINTS, parse_input_file
from controlplane.batches.models import Batch, BatchLine, BatchStatus, File, FilePurpose, new_batch_id
from controlplane.batches.run_services import runner_key_secret
from controlplane.batches.selectors import file_get
from controlplane.batches.tasks import run_batch
from controlplane.catalog.models import Model
from controlplane.common.errors import InvalidInput
from controlplane.tenancy.models import ApiKeyKind, Organization, Project, Scope
from controlplane.tenancy.services import api_key_create

COMPLETION_WINDOWS = {"24h": timedelta(hours=24)}
MAX_METADATA_PAIRS = 16
MAX_METADATA_KEY = 64
MAX_METADATA_VALUE = 512
MAX_FILENAME = 255


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
    project: Project | None = None,
) -> Batch:
    """`project`: where the batch's usage is counted (its runner key's project): the creating key's; None,
    the organization's default project (a batch made from a dashboard session)."""
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
        project=project,
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
    transaction.on_commit(lambda: run_batch.delay(batch.id))
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
        transaction.on_commit(lambda: run_batch.delay(batch.id))
    return batch
