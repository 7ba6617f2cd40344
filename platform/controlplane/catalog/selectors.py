from datetime import datetime, timedelta

from django.conf import settings
from django.db.models import QuerySet

from controlplane.catalog.models import LIVE_WORKER_STATES, Fleet, Model, Worker
from controlplane.common.errors import ObjectNotFound
from controlplane.common.tokens import hash_token


def heartbeat_deadline(*, now: datetime) -> datetime:
    """Workers whose last heartbeat is older than this are dead, whether or not they are marked so yet."""
    return now - timedelta(seconds=settings.DIPTYCH_WORKER_DEAD_AFTER_SECONDS)


def model_list() -> QuerySet[Model]:
    return Model.objects.order_by("name")


def model_get(*, name: str) -> Model:
    model = Model.objects.filter(name=name).first()
    if model is None:
        raise ObjectNotFound(f"Model {name!r} not found.")
    return model


def fleet_list() -> QuerySet[Fleet]:
    return Fleet.objects.select_related("model").order_by("name")


def fleet_get_by_token(*, token: str) -> Fleet | None:
    return Fleet.objects.select_related("model").filter(token_hash=hash_token(token)).first()


def worker_list_live(*, now: datetime) -> QuerySet[Worker]:
    return (
        Worker.objects.select_related("fleet__model")
        .filter(state__in=LIVE_WORKER_STATES, last_heartbeat_at__gte=heartbeat_deadline(now=now))
        .order_by("fleet__name", "name", "id")
    )
