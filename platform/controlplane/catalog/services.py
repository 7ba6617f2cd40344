import hashlib
import logging
import re
import shutil
import tempfile
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from datetime import datetime, timedelta
from pathlib import Path
from typing import BinaryIO

from django.db import IntegrityError, transaction
from django.db.models import Case, Value, When
from django.utils import timezone
from django.utils.crypto import salted_hmac

from controlplane.catalog.artifact_store import (
    CHUNK_BYTES,
    ArtifactStore,
    artifact_key,
    artifact_store,
    staging_folder,
)
from controlplane.catalog.models import (
    ARTIFACTS_SOURCE,
    LIVE_WORKER_STATES,
    REVISION_MAX_LENGTH,
    Fleet,
    FleetRole,
    Model,
    ModelFile,
    Price,
    PriceTier,
    Worker,
    WorkerState,
)
from controlplane.catalog.selectors import fleet_get_by_token, heartbeat_deadline, revision_exists
from controlplane.common.errors import InvalidInput, ObjectGone, ObjectNotFound
from controlplane.common.tokens import generate_token, hash_token
from controlplane.tenancy.access import SYSTEM, Principal
from controlplane.tenancy.services import audit_record
from diptych_common.artifacts import ArtifactFile, model_directory_files, sha256_of

logger = logging.getLogger(__name__)

FLEET_TOKEN_PREFIX = "dft"
LOCAL_REGION = "local"
LOCAL_HARDWARE_CLASS = "cpu"
WORKER_RPC_SECRET_LABEL = "diptych.catalog.worker-rpc-secret"


def worker_rpc_secret() -> str:
    """The credential of the internal worker API, which only the gateway and registered workers receive.

    Derived from the control plane's secret key, so every control-plane replica hands out the same one
    with nothing stored; a new secret key gives a new secret (see docs/architecture.md on rotation).
    """
    return salted_hmac(WORKER_RPC_SECRET_LABEL, "v1", algorithm="sha256").hexdigest()


@dataclass(frozen=True)
class WorkerLoad:
    queue_depth: int = 0
    active_sequences: int = 0
    kv_blocks_free: int = 0
    kv_blocks_total: int = 0
    tokens_per_second: float = 0.0


# A new price may start this long before the call, to absorb clock skew between clients and us.
PRICE_START_GRACE = timedelta(minutes=1)


def model_ensure(*, name: str, source: str, context_length: int, family: str, dtype: str, tokenizer: str = "") -> Model:
    model, _ = Model.objects.update_or_create(
        name=name,
        defaults={
            "source": source,
            "context_length": context_length,
            "family": family,
            "dtype": dtype,
            "tokenizer": tokenizer,
        },
    )
    return model


@transaction.atomic
def price_set(
    *,
    model: Model,
    phase: str,
    micros_per_million: int,
    effective_from: datetime | None = None,
    actor: Principal = SYSTEM,
    tier: str = PriceTier.STANDARD,
) -> Price:
    """Add a price for (model, phase, tier) from `effective_from` (default now) on.

    Only the first price of a pair may start in the past; later ones start now or later, so usage that
    was already rated is never re-priced.
    """
    now = timezone.now()
    effective_from = effective_from or now
    # Serialises price changes of one model, so the "first price" test cannot race.
    Model.objects.select_for_update().get(pk=model.pk)
    earlier = Price.objects.filter(model=model, phase=phase, tier=tier)
    if earlier.exists() and effective_from < now - PRICE_START_GRACE:
        raise InvalidInput(
            f"A new price for {model.name}/{phase}/{tier} cannot start in the past ({effective_from.isoformat()}): "
            "usage already rated must keep its price.",
            fields={"effective_from": ["Must be now or later."]},
        )
    if earlier.filter(effective_from=effective_from).exists():
        raise InvalidInput(
            f"{model.name}/{phase}/{tier} already has a price starting at {effective_from.isoformat()}.",
            fields={"effective_from": ["Already taken for this model and phase."]},
        )
    price = Price.objects.create(
        model=model, phase=phase, tier=tier, micros_per_million=micros_per_million, effective_from=effective_from
    )
    audit_record(
        actor=actor,
        organization=None,
        action="price.create",
        target_type="model",
        target_id=model.name,
        details={
            "phase": phase,
            "tier": tier,
            "micros_per_million": micros_per_million,
            "effective_from": effective_from.isoformat(),
        },
    )
    return price


def price_ensure_initial(
    *, model: Model, phase: str, micros_per_million: int, effective_from: datetime, tier: str = PriceTier.STANDARD
) -> Price:
    """The model's price for (`phase`, `tier`), set to `micros_per_million` from `effective_from` if it has none yet."""
    existing = Price.objects.filter(model=model, phase=phase, tier=tier).order_by("effective_from").first()
    if existing is not None:
        return existing
    return price_set(
        model=model, phase=phase, tier=tier, micros_per_million=micros_per_million, effective_from=effective_from
    )


def fleet_ensure(*, name: str, role: str, model: Model, region: str, hardware_class: str) -> Fleet:
    fleet, _ = Fleet.objects.update_or_create(
        name=name,
        defaults={"role": role, "model": model, "region": region, "hardware_class": hardware_class},
    )
    return fleet


def fleet_token_rotate(*, fleet: Fleet) -> str:
    """Issue a new token for the fleet; the previous one stops working at once."""
    token = generate_token(FLEET_TOKEN_PREFIX)
    fleet.token_hash = hash_token(token)
    fleet.save(update_fields=["token_hash"])
    return token


def fleet_name(
    *, model_name: str, role: str, region: str = LOCAL_REGION, hardware_class: str = LOCAL_HARDWARE_CLASS
) -> str:
    """`diptych-tiny` gives `tiny-prefill`, `tiny-decode`, `tiny-colocated`; other models keep their name. A
    region or hardware class other than the local defaults is appended (`tiny-prefill-west`,
    `tiny-decode-us-east-1-h100`), so each region's and hardware's fleets are their own."""
    name = f"{model_name.removeprefix('diptych-')}-{role}"
    if region != LOCAL_REGION:
        name += f"-{region}"
    if hardware_class != LOCAL_HARDWARE_CLASS:
        name += f"-{hardware_class}"
    return name


def fleet_tokens_issue(*, model: Model, region: str, hardware_class: str, kept: Mapping[str, str]) -> dict[str, str]:
    """Ensures the model's fleet of each role in the region and hardware class, and issues each a fresh token
    unless `kept` holds one (role -> token) that still works for it; returns each role's token."""
    tokens = {}
    for role in FleetRole.values:
        fleet = fleet_ensure(
            name=fleet_name(model_name=model.name, role=role, region=region, hardware_class=hardware_class),
            role=role,
            model=model,
            region=region,
            hardware_class=hardware_class,
        )
        kept_token = kept.get(role, "")
        still_works = kept_token and fleet_get_by_token(token=kept_token) == fleet
        tokens[role] = kept_token if still_works else fleet_token_rotate(fleet=fleet)
    return tokens


@transaction.atomic
def worker_register(*, fleet: Fleet, name: str, address: str, revision: str = "") -> Worker:
    """Register a worker; a live worker already at this address in the fleet is replaced (marked dead).

    `revision` is the published revision of the fleet's model that the worker loaded ("" for a builtin or
    local source); the worker is told to drain once a worker of the model's current revision is ready.
    """
    if revision and not revision_exists(model=fleet.model, revision=revision):
        raise InvalidInput(
            f"Model {fleet.model.name!r} has no published revision {revision!r}.",
            fields={"revision": ["Not a published revision of the fleet's model."]},
        )
    # Serialises registrations of one fleet, so two of them cannot both see the address as free.
    Fleet.objects.select_for_update().get(pk=fleet.pk)
    replaced = Worker.objects.filter(fleet=fleet, address=address, state__in=LIVE_WORKER_STATES).update(
        state=WorkerState.DEAD
    )
    if replaced:
        logger.info("Worker at %s in fleet %s re-registered; its previous registration is dead.", address, fleet.name)
    now = timezone.now()
    return Worker.objects.create(
        fleet=fleet,
        name=name,
        address=address,
        state=WorkerState.READY,
        registered_at=now,
        last_heartbeat_at=now,
        revision=revision,
    )


def worker_heartbeat(*, fleet: Fleet, worker_id: str, state: str, load: WorkerLoad) -> Worker:
    """Record a live worker's state and load.

    A heartbeat proves the worker alive, however late it comes: silence may be the control plane's own
    outage, which the worker heartbeated through. A worker marked dead is revived in place (same id, no
    new registration), unless a newer registration took its address (ObjectGone: it registers again).
    A worker of a superseded revision is told to drain (see `_revision_superseded`).
    """
    worker = Worker.objects.filter(fleet=fleet, public_id=worker_id).first()
    if worker is None:
        raise ObjectNotFound(f"Worker {worker_id!r} not found in fleet {fleet.name!r}.")
    if _revision_superseded(worker):
        state = WorkerState.DRAINING
    # A drain requested by staff wins over the state the worker reports, even one requested concurrently.
    state_after = Case(When(drain_requested_at__isnull=False, then=Value(WorkerState.DRAINING)), default=Value(state))
    fields = {"state": state_after, "last_heartbeat_at": timezone.now(), **asdict(load)}
    # Conditional updates keep this right when the periodic job marks the worker dead concurrently.
    if not Worker.objects.filter(pk=worker.pk, state__in=LIVE_WORKER_STATES).update(**fields):
        _worker_revive(worker, fields)
    worker.refresh_from_db()
    return worker


def _revision_superseded(worker: Worker) -> bool:
    """Whether the worker serves another revision than its model's current one, which a ready worker of its
    fleet already serves: only then does it drain, so a revision change never leaves the fleet without
    capacity."""
    current = Model.objects.get(fleets=worker.fleet_id).published_revision
    if not current or worker.revision == current:
        return False
    return Worker.objects.filter(
        fleet_id=worker.fleet_id,
        revision=current,
        state=WorkerState.READY,
        drain_requested_at__isnull=True,
        last_heartbeat_at__gte=heartbeat_deadline(now=timezone.now()),
    ).exists()


def _worker_revive(worker: Worker, fields: dict) -> None:
    taken = Worker.objects.filter(
        fleet_id=worker.fleet_id, address=worker.address, state__in=LIVE_WORKER_STATES
    ).exclude(pk=worker.pk)
    revived = 0
    if not taken.exists():
        try:
            with transaction.atomic():  # a registration racing for the address wins: one live worker per address
                revived = Worker.objects.filter(pk=worker.pk).update(**fields)
        except IntegrityError:
            revived = 0
    if not revived:
        raise ObjectGone(
            f"Worker {worker.public_id!r} was replaced by a newer registration at {worker.address}; register again.",
            error_type="worker_dead",
        )
    logger.info("Worker %s heartbeated again after being marked dead; it is live again.", worker.public_id)


@transaction.atomic
def worker_drain(*, worker: Worker, actor: Principal = SYSTEM) -> Worker:
    """Ask a live worker to finish its work and take none: the registry and its next heartbeat say draining."""
    if worker.state == WorkerState.DEAD:
        raise ObjectGone(f"Worker {worker.public_id!r} is dead; there is nothing to drain.", error_type="worker_dead")
    now = timezone.now()
    Worker.objects.filter(pk=worker.pk, drain_requested_at__isnull=True).update(drain_requested_at=now)
    Worker.objects.filter(pk=worker.pk, state=WorkerState.READY).update(state=WorkerState.DRAINING)
    worker.refresh_from_db(fields=["state", "drain_requested_at"])
    audit_record(
        actor=actor,
        organization=None,
        action="worker.drain",
        target_type="worker",
        target_id=worker.public_id,
        details={"fleet": worker.fleet.name, "address": worker.address},
    )
    return worker


def workers_mark_silent_dead(*, now: datetime | None = None) -> int:
    """Mark dead every live worker whose last heartbeat is past the deadline; returns how many."""
    deadline = heartbeat_deadline(now=now or timezone.now())
    count = Worker.objects.filter(state__in=LIVE_WORKER_STATES, last_heartbeat_at__lt=deadline).update(
        state=WorkerState.DEAD
    )
    if count:
        logger.info("Marked %d silent worker(s) dead.", count)
    return count


# ---- publishing model artifacts -------------------------------------------------------------------------

REVISION_PATTERN = re.compile(rf"[A-Za-z0-9][A-Za-z0-9._-]{{0,{REVISION_MAX_LENGTH - 1}}}")


@dataclass(frozen=True)
class Publication:
    """A directory hashed and checked, ready to be published as `revision`."""

    directory: Path
    revision: str
    files: list[ArtifactFile]


@dataclass(frozen=True)
class PublishedRevision:
    model: Model
    revision: str
    files: list[ArtifactFile]
    uploaded: bool  # False when this revision was already published with the same content


def directory_manifest(directory: Path) -> list[ArtifactFile]:
    """Every file under `directory` (dot-files and dot-folders aside) with its size and sha256, by path."""
    if not directory.is_dir():
        raise InvalidInput(f"{directory} is not a directory.", fields={"directory": ["Not a directory."]})
    entries = [
        ArtifactFile(path=path, size=(directory / path).stat().st_size, sha256=sha256_of(directory / path))
        for path in model_directory_files(directory)
    ]
    if not entries:
        raise InvalidInput(f"{directory} holds no files to publish.", fields={"directory": ["No files."]})
    return entries


def manifest_revision(entries: list[ArtifactFile]) -> str:
    """The content-addressed revision: 12 hex digits of the sha256 of the sorted "<sha256>  <path>" lines."""
    lines = sorted(f"{entry.sha256}  {entry.path}\n" for entry in entries)
    return hashlib.sha256("".join(lines).encode()).hexdigest()[:12]


def publication_prepare(*, model_name: str, directory: Path, revision: str = "") -> Publication:
    """Hash the directory's files and check that they may be published as `revision` of the model (default:
    content-addressed); refuses (InvalidInput) a revision already published with other content."""
    files = directory_manifest(directory)
    revision = revision or manifest_revision(files)
    if not REVISION_PATTERN.fullmatch(revision):
        raise InvalidInput(
            f"Revision {revision!r} is not allowed: use 1 to {REVISION_MAX_LENGTH} letters, digits, '.', '_' or '-', "
            "starting with a letter or digit.",
            fields={"revision": ["Invalid revision."]},
        )
    model = Model.objects.filter(name=model_name).first()
    if model is not None:
        _check_same_content(model=model, revision=revision, files=files)
    return Publication(directory=directory, revision=revision, files=files)


def model_publish(
    *, model: Model, publication: Publication, store: ArtifactStore | None = None, actor: Principal = SYSTEM
) -> PublishedRevision:
    """Upload the publication's files and make its revision the model's current one, which the model's
    workers then load and its older workers drain for.

    A revision's files never change: publishing it again with other content is refused and changes nothing,
    in the catalog or in the store; with the same content nothing is uploaded and the revision becomes
    current again.
    """
    revision, files = publication.revision, publication.files
    if _check_same_content(model=model, revision=revision, files=files):
        uploaded = False
        with transaction.atomic():
            Model.objects.select_for_update().get(pk=model.pk)
            _revision_make_current(model=model, publication=publication, actor=actor)
    else:
        store = store or artifact_store()
        uploaded = _revision_publish_staged(model=model, publication=publication, store=store, actor=actor)
    model.refresh_from_db()
    return PublishedRevision(model=model, revision=revision, files=files, uploaded=uploaded)


def _revision_publish_staged(*, model: Model, publication: Publication, store: ArtifactStore, actor: Principal) -> bool:
    """Uploads the files to a staging folder of this publication's own, then checks the revision again under
    the model's lock and moves them to the revision's keys only if this publication records it: one refused
    there (a concurrent one recorded other content) or beaten to it with the same content leaves nothing in
    the store. Returns whether this publication recorded the revision."""
    staging = staging_folder()
    try:
        for entry in publication.files:
            store.put(f"{staging}/{entry.path}", publication.directory / entry.path)
        with transaction.atomic():
            # Serialises publications of one model; one of the same revision since the first check is seen here.
            Model.objects.select_for_update().get(pk=model.pk)
            records = not _check_same_content(model=model, revision=publication.revision, files=publication.files)
            if records:
                _revision_files_record(model=model, publication=publication, store=store, staging=staging)
            _revision_make_current(model=model, publication=publication, actor=actor)
        return records
    finally:
        _staging_discard(store, staging)


def _revision_files_record(*, model: Model, publication: Publication, store: ArtifactStore, staging: str) -> None:
    """Moves the staged files to the revision's keys and records them. It runs under the model's lock and
    before the commit, so no other publication of the revision writes there meanwhile and the catalog never
    lists a file the store lacks."""
    for entry in publication.files:
        key = artifact_key(model=model.name, revision=publication.revision, path=entry.path)
        store.move(f"{staging}/{entry.path}", key)
    ModelFile.objects.bulk_create(
        ModelFile(model=model, revision=publication.revision, path=entry.path, size=entry.size, sha256=entry.sha256)
        for entry in publication.files
    )


def _revision_make_current(*, model: Model, publication: Publication, actor: Principal) -> None:
    files = publication.files
    Model.objects.filter(pk=model.pk).update(revision=publication.revision, source=ARTIFACTS_SOURCE)
    audit_record(
        actor=actor,
        organization=None,
        action="model.publish",
        target_type="model",
        target_id=model.name,
        details={"revision": publication.revision, "files": len(files), "bytes": sum(entry.size for entry in files)},
    )


def _staging_discard(store: ArtifactStore, staging: str) -> None:
    """Deletes what is left in the staging folder; a failure is logged, not raised, as the publication's
    outcome stands and the leftover sits under no revision's keys."""
    try:
        store.delete_folder(staging)
    except Exception:
        logger.warning("Could not delete the staged upload %s from the artifact store.", staging, exc_info=True)


@dataclass(frozen=True)
class ModelRegistered:
    model: Model
    revision: str  # the model's current revision
    fleet_tokens: dict[str, str]  # role -> a fresh token; empty when the model's fleets kept theirs


def model_register(
    *,
    name: str,
    context_length: int,
    family: str,
    dtype: str,
    files: Sequence[tuple[str, BinaryIO]],
    revision: str = "",
    actor: Principal = SYSTEM,
) -> ModelRegistered:
    """Adds (or updates) the model with its prefill, decode and colocated fleets in the local region, and
    publishes `files` ((path, content) each) as `revision` of the model (default: named by their content),
    which becomes the revision its workers load.

    Fleet tokens are issued only to a model whose fleets do not all hold one; the others keep theirs, so
    that a new revision's workers use them. Everything is hashed and checked before anything changes: a
    refused revision changes nothing.
    """
    with tempfile.TemporaryDirectory(prefix="diptych-model-") as folder:
        directory = _written_directory(files, Path(folder))
        publication = publication_prepare(model_name=name, directory=directory, revision=revision)
        fleet_tokens = _catalog_entry_ensure(name=name, context_length=context_length, family=family, dtype=dtype)
        published = model_publish(model=Model.objects.get(name=name), publication=publication, actor=actor)
    return ModelRegistered(model=published.model, revision=published.revision, fleet_tokens=fleet_tokens)


def _written_directory(files: Sequence[tuple[str, BinaryIO]], directory: Path) -> Path:
    """`directory` holding each file at its path; InvalidInput names every path that cannot be published."""
    problems = _file_path_problems([path for path, _ in files])
    if problems:
        first_field, first_problems = next(iter(problems.items()))
        more = f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""
        raise InvalidInput(f"Nothing was stored. {first_field}: {first_problems[0]}{more}", fields=problems)
    for path, content in files:
        target = directory / path
        target.parent.mkdir(parents=True, exist_ok=True)
        with target.open("wb") as out:
            shutil.copyfileobj(content, out, CHUNK_BYTES)
    return directory


def _file_path_problems(paths: Sequence[str]) -> dict[str, list[str]]:
    """What is wrong with each path that cannot be published, by its place in `paths`."""
    folders = {"/".join(parts[:end]) for parts in (path.split("/") for path in paths) for end in range(1, len(parts))}
    seen: set[str] = set()
    problems = {}
    for index, path in enumerate(paths):
        if not _publishable(path):
            problems[f"paths[{index}]"] = [
                f"{path!r} cannot be published: give a relative POSIX path, no part of it empty, over 255 bytes or "
                "starting with '.' (dot-files and dot-folders are never published)."
            ]
        elif path in seen or path in folders:
            problems[f"paths[{index}]"] = [f"{path!r} is named twice, as a file or as a folder."]
        seen.add(path)
    return problems


def _publishable(path: str) -> bool:
    parts = path.split("/")
    return (
        "\\" not in path
        and "\x00" not in path
        and all(part and not part.startswith(".") and len(part.encode()) <= 255 for part in parts)
    )


@transaction.atomic
def _catalog_entry_ensure(*, name: str, context_length: int, family: str, dtype: str) -> dict[str, str]:
    """The model's catalog entry, published as artifacts, and its fleets with fresh tokens; the fleets of a
    model that hold a token for every role keep theirs, and none is returned."""
    existing = Model.objects.filter(name=name).first()
    roles_with_tokens = set(
        Fleet.objects.filter(model__name=name, token_hash__isnull=False).values_list("role", flat=True)
    )
    model = model_ensure(name=name, source=ARTIFACTS_SOURCE, context_length=context_length, family=family, dtype=dtype)
    if existing is not None and roles_with_tokens >= set(FleetRole.values):
        return {}
    return fleet_tokens_issue(model=model, region=LOCAL_REGION, hardware_class=LOCAL_HARDWARE_CLASS, kept={})


def _check_same_content(*, model: Model, revision: str, files: list[ArtifactFile]) -> bool:
    """Whether `revision` is already published; refuses (InvalidInput) when it is, with other content."""
    published = {
        ArtifactFile(path=path, size=size, sha256=sha256)
        for path, size, sha256 in ModelFile.objects.filter(model=model, revision=revision).values_list(
            "path", "size", "sha256"
        )
    }
    if not published:
        return False
    if published != set(files):
        changed = sorted({entry.path for entry in published.symmetric_difference(files)})
        raise InvalidInput(
            f"Revision {revision!r} of model {model.name!r} is already published with other content "
            f"({', '.join(changed[:5])}{' ...' if len(changed) > 5 else ''} differ); a revision's files never "
            "change: publish under a new revision.",
            fields={"revision": ["Already published with other content."]},
        )
    return True
