"""Reads' shared pieces of query building."""

from typing import TypeVar

from django.db.models import Model, QuerySet

M = TypeVar("M", bound=Model)


def where_given(rows: QuerySet[M], **lookups: object) -> QuerySet[M]:
    """`rows` filtered by each of `lookups` whose value was given (is not None): a list's optional filters."""
    given = {lookup: value for lookup, value in lookups.items() if value is not None}
    return rows.filter(**given) if given else rows
