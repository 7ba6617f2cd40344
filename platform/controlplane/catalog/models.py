from django.db import models
from django.db.models import Q

from controlplane.common.ids import PUBLIC_ID_MAX_LENGTH, new_public_id

REVISION_MAX_LENGTH = 64
ARTIFACTS_SOURCE = "artifacts"  # a model's source once published: workers fetch its current revision's files


def new_worker_id() -> str:
    return new_public_id("wrk")


class Model(models.Model):
    """A model the platform serves, e.g. `diptych-tiny`."""

    name = models.CharField(max_length=200, unique=True)
    source = models.CharField(
        max_length=1000, help_text="`builtin:<name>` or a local directory of Hugging Face weights."
    )
    context_length = models.PositiveIntegerField()
    family = models.CharField(max_length=50)
    dtype = models.CharField(max_length=20)
    tokenizer = models.CharField(
        max_length=1000, blank=True, default="", help_text="Where the tokenizer comes from; empty means the source."
    )
    revision = models.CharField(
        max_length=REVISION_MAX_LENGTH,
        blank=True,
        default="",
        help_text="The published revision its workers load (source `artifacts`); empty when none.",
    )
    created_at = models.DateTimeField(auto_now_add=True)

    def __str__(self) -> str:
        return self.name

    @property
    def published_revision(self) -> str:
        """The revision workers load; "" unless the source is published files (a bootstrap may have set a
        builtin or local source again since)."""
        return self.revision if self.source == ARTIFACTS_SOURCE else ""


class ModelFile(models.Model):
    """One file of a published revision of a model, as kept in the artifact store; rows are never changed."""

    model = models.ForeignKey(Model, on_delete=models.PROTECT, related_name="files")
    revision = models.CharField(max_length=REVISION_MAX_LENGTH)
    path = models.CharField(max_length=1000, help_text="Relative POSIX path inside the model directory.")
    size = models.PositiveBigIntegerField()
    sha256 = models.CharField(max_length=64)
    created_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        constraints = [
            models.UniqueConstraint(fields=["model", "revision", "path"], name="catalog_modelfile_one_per_path"),
        ]

    def __str__(self) -> str:
        return f"{self.model.name}@{self.revision}/{self.path}"


class PricePhase(models.TextChoices):
    """What a token is billed as: prompt tokens computed, prompt tokens from the prefix cache, output tokens."""

    PREFILL = "prefill"
    CACHED_PREFILL = "cached_prefill"
    DECODE = "decode"


class PriceTier(models.TextChoices):
    """Who a price is for: requests sent one by one, or the Batch API's (run in spare capacity, cheaper)."""

    STANDARD = "standard"
    BATCH = "batch"


class Price(models.Model):
    """Price of one phase of one model from `effective_from` on, until the next price of that pair.

    Rows are never updated: a change of price is a new row, so usage is always rated at the price in
    effect when it happened.
    """

    model = models.ForeignKey(Model, on_delete=models.PROTECT, related_name="prices")
    phase = models.CharField(max_length=16, choices=PricePhase.choices)
    tier = models.CharField(max_length=16, choices=PriceTier.choices, default=PriceTier.STANDARD)
    micros_per_million = models.PositiveBigIntegerField(help_text="Micro-dollars per million tokens.")
    effective_from = models.DateTimeField()
    created_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        constraints = [
            models.UniqueConstraint(
                fields=["model", "phase", "tier", "effective_from"], name="catalog_price_one_per_tier_and_instant"
            ),
        ]

    def __str__(self) -> str:
        return (
            f"{self.model.name}/{self.phase}/{self.tier}: {self.micros_per_million} µ$/Mtok from {self.effective_from}"
        )


class FleetRole(models.TextChoices):
    PREFILL = "prefill"
    DECODE = "decode"
    COLOCATED = "colocated"


class Fleet(models.Model):
    """Workers of one role, one model, one region and one hardware class."""

    name = models.CharField(max_length=100, unique=True)
    role = models.CharField(max_length=16, choices=FleetRole.choices)
    model = models.ForeignKey(Model, on_delete=models.PROTECT, related_name="fleets")
    region = models.CharField(max_length=64)
    hardware_class = models.CharField(max_length=64)
    # Null until a token is issued; workers register with the token, whose SHA-256 only is kept.
    token_hash = models.CharField(max_length=64, unique=True, null=True, blank=True, editable=False)
    created_at = models.DateTimeField(auto_now_add=True)

    def __str__(self) -> str:
        return self.name


class WorkerState(models.TextChoices):
    READY = "ready"
    DRAINING = "draining"
    DEAD = "dead"


LIVE_WORKER_STATES = [WorkerState.READY, WorkerState.DRAINING]


class Worker(models.Model):
    public_id = models.CharField(max_length=PUBLIC_ID_MAX_LENGTH, unique=True, default=new_worker_id, editable=False)
    fleet = models.ForeignKey(Fleet, on_delete=models.CASCADE, related_name="workers")
    name = models.CharField(max_length=100)
    address = models.CharField(max_length=300, help_text="host:port of the worker's gRPC server.")
    state = models.CharField(max_length=16, choices=WorkerState.choices, default=WorkerState.READY)
    registered_at = models.DateTimeField()
    last_heartbeat_at = models.DateTimeField()
    queue_depth = models.PositiveIntegerField(default=0)
    active_sequences = models.PositiveIntegerField(default=0)
    kv_blocks_free = models.PositiveIntegerField(default=0)
    kv_blocks_total = models.PositiveIntegerField(default=0)
    tokens_per_second = models.FloatField(default=0.0)
    revision = models.CharField(
        max_length=REVISION_MAX_LENGTH, blank=True, default="", help_text="The model revision the worker loaded."
    )
    drain_requested_at = models.DateTimeField(
        null=True, blank=True, help_text="Set by staff: the worker finishes its work and takes no new work."
    )

    class Meta:
        constraints = [
            models.UniqueConstraint(
                fields=["fleet", "address"],
                condition=~Q(state="dead"),
                name="catalog_worker_one_live_worker_per_address",
            ),
        ]
        indexes = [models.Index(fields=["state", "last_heartbeat_at"])]

    def __str__(self) -> str:
        return f"{self.name} ({self.public_id})"
