import logging
from dataclasses import asdict, dataclass
from datetime import datetime, timedelta

from django.db import transaction
from django.db.models import Case, Value, When
from django.utils import timezone

from controlplane.catalog.models import LIVE_WORKER_STATES, Fleet, Model, Price, Worker, WorkerState
from controlplane.catalog.selectors import heartbeat_deadline
from controlplane.common.errors import InvalidInput, ObjectGone, ObjectNotFound
from controlplane.common.tokens import generate_token, hash_token
from controlplane.tenancy.access import SYSTEM, Principal
from controlplane.tenancy.services import audit_record

logger = logging.getLogger(__name__)

FLEET_TOKEN_PREFIX = "dft"


@dataclass(frozen=True)
class WorkerLoad:
    queue_depth: int = 0
    active_sequences: int = 0
    kv_blocks_free: int = 0
    kv_blocks_total: int = 0
    tokens_per_second: float = 0.0


# A new price may start this long before the call, to absorb clock skew between clients and us.
PRICE_START_GRACE = timedelta(minutes=1)


def model_ensure(
    *, name: str, source: str, context_length: int, family: str, dtype: str, tokenizer: str = ""
) -> Model:
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
) -> Price:
    """Add a price for (model, phase) from `effective_from` (default now) on.

    Only the first price of a pair may start in the past; later ones start now or later, so usage that
    was already rated is never re-priced.
    """
    now = timezone.now()
    effective_from = effective_from or now
    # Serialises price changes of one model, so the "first price" test cannot race.
    Model.objects.select_for_update().get(pk=model.pk)
    earlier = Price.objects.filter(model=model, phase=phase)
    if earlier.exists() and effective_from < now - PRICE_START_GRACE:
        raise InvalidInput(
            f"A new price for {model.name}/{phase} cannot start in the past ({effective_from.isoformat()}): "
            "usage already rated must keep its price.",
            fields={"effective_from": ["Must be now or later."]},
        )
    if earlier.filter(effective_from=effective_from).exists():
        raise InvalidInput(
            f"{model.name}/{phase} already has a price starting at {effective_from.isoformat()}.",
            fields={"effective_from": ["Already taken for this model and phase."]},
        )
    price = Price.objects.create(
        model=model, phase=phase, micros_per_million=micros_per_million, effective_from=effective_from
    )
    audit_record(
        actor=actor, organization=None, action="price.create", target_type="model", target_id=model.name,
        details={
            "phase": phase,
            "micros_per_million": micros_per_million,
            "effective_from": effective_from.isoformat(),
        },
    )
    return price


def price_ensure_initial(*, model: Model, phase: str, micros_per_million: int, effective_from: datetime) -> Price:
    """The model's price for `phase`, set to `micros_per_million` from `effective_from` if it has none yet."""
    existing = Price.objects.filter(model=model, phase=phase).order_by("effective_from").first()
    if existing is not None:
        return existing
    return price_set(model=model, phase=phase, micros_per_million=micros_per_million, effective_from=effective_from)


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


@transaction.atomic
def worker_register(*, fleet: Fleet, name: str, address: str) -> Worker:
    """Register a worker; a live worker already at this address in the fleet is replaced (marked dead)."""
    # Serialises registrations of one fleet, so two of them cannot both see the address as free.
    Fleet.objects.select_for_update().get(pk=fleet.pk)
    replaced = (
        Worker.objects.filter(fleet=fleet, address=address, state__in=LIVE_WORKER_STATES)
        .update(state=WorkerState.DEAD)
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
    )


def worker_heartbeat(*, fleet: Fleet, worker_id: str, state: str, load: WorkerLoad) -> Worker:
    """Record a live worker's state and load; a worker past its heartbeat deadline is dead (ObjectGone)."""
    worker = Worker.objects.filter(fleet=fleet, public_id=worker_id).first()
    if worker is None:
        raise ObjectNotFound(f"Worker {worker_id!r} not found in fleet {fleet.name!r}.")
    now = timezone.now()
    # A drain requested by staff wins over the state the worker reports, even one requested concurrently.
    state_after = Case(When(drain_requested_at__isnull=False, then=Value(WorkerState.DRAINING)), default=Value(state))
    fields = {"state": state_after, "last_heartbeat_at": now, **asdict(load)}
    # Conditional updates keep this right when the periodic job marks the worker dead concurrently.
    alive = Worker.objects.filter(
        pk=worker.pk, state__in=LIVE_WORKER_STATES, last_heartbeat_at__gte=heartbeat_deadline(now=now)
    )
    if not alive.update(**fields):
        # A late heartbeat is refused even before the periodic job marks the worker dead, so the
        # answer never depends on that job's timing.
        Worker.objects.filter(pk=worker.pk, state__in=LIVE_WORKER_STATES).update(state=WorkerState.DEAD)
        raise ObjectGone(
            f"Worker {worker_id!r} was marked dead after missed heartbeats; register again.",
            error_type="worker_dead",
        )
    worker.refresh_from_db()
    return worker


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
        actor=actor, organization=None, action="worker.drain", target_type="worker", target_id=worker.public_id,
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
