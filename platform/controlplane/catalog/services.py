import logging
from dataclasses import asdict, dataclass
from datetime import datetime

from django.db import transaction
from django.utils import timezone

from controlplane.catalog.models import LIVE_WORKER_STATES, Fleet, Model, Worker, WorkerState
from controlplane.catalog.selectors import heartbeat_deadline
from controlplane.common.errors import ObjectGone, ObjectNotFound
from controlplane.common.tokens import generate_token, hash_token

logger = logging.getLogger(__name__)

FLEET_TOKEN_PREFIX = "dft"


@dataclass(frozen=True)
class WorkerLoad:
    queue_depth: int = 0
    active_sequences: int = 0
    kv_blocks_free: int = 0
    kv_blocks_total: int = 0
    tokens_per_second: float = 0.0


def model_ensure(*, name: str, source: str, context_length: int, family: str, dtype: str) -> Model:
    model, _ = Model.objects.update_or_create(
        name=name,
        defaults={"source": source, "context_length": context_length, "family": family, "dtype": dtype},
    )
    return model


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
    fields = {"state": state, "last_heartbeat_at": now, **asdict(load)}
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
    for field, value in fields.items():
        setattr(worker, field, value)
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
