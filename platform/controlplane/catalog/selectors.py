from bisect import bisect_right
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any

from django.conf import settings
from django.db.models import Prefetch, QuerySet

from controlplane.catalog.artifact_store import artifact_store
from controlplane.catalog.models import LIVE_WORKER_STATES, Fleet, Model, ModelFile, Price, PriceTier, Worker
from controlplane.common.errors import ObjectNotFound
from controlplane.common.querysets import where_given
from controlplane.common.tokens import hash_token


def heartbeat_deadline(*, now: datetime) -> datetime:
    """Workers whose last heartbeat is older than this are dead, whether or not they are marked so yet."""
    return now - timedelta(seconds=settings.DIPTYCH_WORKER_DEAD_AFTER_SECONDS)


def model_list() -> QuerySet[Model]:
    return Model.objects.prefetch_related(Prefetch("fleets", queryset=Fleet.objects.order_by("name"))).order_by("name")


def model_get(*, name: str) -> Model:
    model = model_list().filter(name=name).first()
    if model is None:
        raise ObjectNotFound(f"Model {name!r} not found.")
    return model


def revision_exists(*, model: Model, revision: str) -> bool:
    return ModelFile.objects.filter(model=model, revision=revision).exists()


def revision_files(*, model: Model, revision: str) -> QuerySet[ModelFile]:
    return ModelFile.objects.filter(model=model, revision=revision).order_by("path")


@dataclass(frozen=True)
class ArtifactManifest:
    """What a model's workers load: its current revision, its files and where they are kept."""

    model: str
    revision: str  # "" when the model is not published as artifacts
    source: str
    files: list[ModelFile]
    store: dict[str, Any] | None  # None when there are no files to fetch


def model_manifest(*, name: str, files_url: Callable[[str], str]) -> ArtifactManifest:
    """The manifest of the named model; `files_url(revision)` is where the control plane serves the files."""
    model = Model.objects.filter(name=name).first()  # fresh: a publication may have just changed the revision
    if model is None:
        raise ObjectNotFound(f"Model {name!r} not found.")
    revision = model.published_revision
    if not revision:
        return ArtifactManifest(model=model.name, revision="", source=model.source, files=[], store=None)
    return ArtifactManifest(
        model=model.name,
        revision=revision,
        source=model.source,
        files=list(revision_files(model=model, revision=revision)),
        store=artifact_store().describe(model=model.name, revision=revision, served_at=files_url(revision)),
    )


def fleet_model_file_get(*, fleet: Fleet, model: str, revision: str, path: str) -> ModelFile:
    """A published file of the fleet's own model; any other (another model's, unknown) is not found alike."""
    return _model_file_get(ModelFile.objects.filter(model_id=fleet.model_id), model=model, revision=revision, path=path)


def model_file_get(*, model: str, revision: str, path: str) -> ModelFile:
    """A published file of any model (for the gateway, which loads every model's tokenizer)."""
    return _model_file_get(ModelFile.objects.all(), model=model, revision=revision, path=path)


def _model_file_get(files: QuerySet[ModelFile], *, model: str, revision: str, path: str) -> ModelFile:
    model_file = files.select_related("model").filter(model__name=model, revision=revision, path=path).first()
    if model_file is None:
        raise ObjectNotFound(
            f"Model {model!r} has no published file {path!r} in revision {revision!r} that this caller may read."
        )
    return model_file


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


def worker_list(*, state: str | None = None, fleet: str | None = None) -> QuerySet[Worker]:
    """Every registered worker, dead ones included (staff view)."""
    workers = Worker.objects.select_related("fleet__model")
    workers = where_given(workers, state=state, fleet__name=fleet)
    return workers.order_by("fleet__name", "name", "-registered_at", "id")


def worker_get(*, public_id: str) -> Worker:
    worker = Worker.objects.select_related("fleet__model").filter(public_id=public_id).first()
    if worker is None:
        raise ObjectNotFound(f"Worker {public_id!r} not found.")
    return worker


def price_list(*, model: str | None = None, phase: str | None = None, tier: str | None = None) -> QuerySet[Price]:
    prices = Price.objects.select_related("model")
    prices = where_given(prices, model__name=model, phase=phase, tier=tier)
    return prices.order_by("model__name", "phase", "tier", "-effective_from")


@dataclass
class PriceBook:
    """Every price, in memory, to rate many events without a query each."""

    _starts: dict[tuple[str, str, str], list[datetime]] = field(default_factory=dict)
    _prices: dict[tuple[str, str, str], list[int]] = field(default_factory=dict)

    def unit_price(self, *, model: str, phase: str, at: datetime, tier: str = PriceTier.STANDARD) -> int | None:
        """Micro-dollars per million tokens of (model, phase, tier) in effect at `at`; None when unpriced.
        Where no batch price is in effect, batch usage is rated at the standard price."""
        price = self._in_effect((model, phase, tier), at)
        if price is None and tier != PriceTier.STANDARD:
            return self._in_effect((model, phase, PriceTier.STANDARD), at)
        return price

    def _in_effect(self, key: tuple[str, str, str], at: datetime) -> int | None:
        starts = self._starts.get(key)
        if not starts:
            return None
        index = bisect_right(starts, at) - 1
        return self._prices[key][index] if index >= 0 else None


def price_book() -> PriceBook:
    book = PriceBook()
    rows = Price.objects.order_by("effective_from").values_list(
        "model__name", "phase", "tier", "effective_from", "micros_per_million"
    )
    for model_name, phase, tier, effective_from, micros in rows:
        book._starts.setdefault((model_name, phase, tier), []).append(effective_from)
        book._prices.setdefault((model_name, phase, tier), []).append(micros)
    return book
