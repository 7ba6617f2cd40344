"""SQL for latency statistics: milliseconds between two timestamps, and percentile_cont as an aggregate.

PostgreSQL computes both itself. The embedded SQLite database (`make up`) has no percentile_cont, so each
SQLite connection gets one of the same definition (linear interpolation between the two closest ranks), run
by SQLite inside its own aggregation; the ORM never receives the rows.
"""

import math

from django.db.backends.signals import connection_created
from django.db.models import Aggregate, DurationField, ExpressionWrapper, F, FloatField, Func

SQLITE_PERCENTILE_FUNCTION = "diptych_percentile_cont"


class MillisecondsBetween(Func):
    """`end` − `start` in milliseconds, as a float, microseconds kept (the ORM's own timestamp subtraction)."""

    output_field = FloatField()
    template = "CAST(EXTRACT(EPOCH FROM %(expressions)s) * 1000 AS double precision)"

    def __init__(self, start, end):
        super().__init__(ExpressionWrapper(_expression(end) - _expression(start), output_field=DurationField()))

    def as_sqlite(self, compiler, connection, **extra_context):
        # There a duration is an integer of microseconds.
        return super().as_sql(compiler, connection, template="(%(expressions)s / 1000.0)", **extra_context)


def _expression(value):
    return F(value) if isinstance(value, str) else value


class PercentileCont(Aggregate):
    """The continuous percentile `fraction` (0..1) of the expression over the group, nulls left out."""

    function = "percentile_cont"
    name = "PercentileCont"
    output_field = FloatField()
    template = "%(function)s(%(fraction)s) WITHIN GROUP (ORDER BY %(expressions)s)"

    def __init__(self, expression, *, fraction: float, **extra):
        if not 0 <= fraction <= 1:
            raise ValueError(f"A percentile's fraction lies in [0, 1], not {fraction}.")
        self.fraction = float(fraction)
        super().__init__(expression, **extra)

    def as_sql(self, compiler, connection, **extra_context):
        return super().as_sql(compiler, connection, fraction=repr(self.fraction), **extra_context)

    def as_sqlite(self, compiler, connection, **extra_context):
        return super().as_sql(
            compiler,
            connection,
            template=f"{SQLITE_PERCENTILE_FUNCTION}(%(expressions)s, {self.fraction!r})",
            **extra_context,
        )


def percentile_cont(values: list[float], fraction: float) -> float | None:
    """PostgreSQL's percentile_cont over `values`: None for none, else interpolated between the closest ranks."""
    if not values:
        return None
    ordered = sorted(values)
    position = fraction * (len(ordered) - 1)
    below, above = math.floor(position), math.ceil(position)
    return ordered[below] + (ordered[above] - ordered[below]) * (position - below)


class _SqlitePercentile:
    def __init__(self) -> None:
        self.values: list[float] = []
        self.fraction = 0.5

    def step(self, value, fraction) -> None:
        self.fraction = float(fraction)
        if value is not None:
            self.values.append(float(value))

    def finalize(self) -> float | None:
        return percentile_cont(self.values, self.fraction)


def _register_on_sqlite(sender, connection, **kwargs) -> None:
    if connection.vendor == "sqlite":
        connection.connection.create_aggregate(SQLITE_PERCENTILE_FUNCTION, 2, _SqlitePercentile)


def register_sqlite_percentile() -> None:
    connection_created.connect(_register_on_sqlite, dispatch_uid="diptych-metering-sqlite-percentile")
