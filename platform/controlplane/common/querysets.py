"""Reads' shared pieces of query building: a list's optional filters, and cursor pages."""

from dataclasses import dataclass
from typing import Any, TypeVar

from django.db.models import Model, QuerySet

from controlplane.common.errors import ObjectNotFound

M = TypeVar("M", bound=Model)


def where_given(rows: QuerySet[M], **lookups: object) -> QuerySet[M]:
    """`rows` filtered by each of `lookups` whose value was given (is not None): a list's optional filters."""
    given = {lookup: value for lookup, value in lookups.items() if value is not None}
    return rows.filter(**given) if given else rows


MAX_PAGE = 100  # rows of a cursor page at most


@dataclass(frozen=True)
class CursorPage:
    """One page of a list in creation order, newest first; the next page starts `after` the last id."""

    items: list[Any]
    has_more: bool


def cursor_page(queryset: QuerySet[Any], *, after: str | None, limit: int) -> CursorPage:
    """`limit` rows of `queryset` (newest first) created before the row whose public id is `after`."""
    rows = queryset.order_by("-id")
    if after:
        anchor = rows.filter(public_id=after).values_list("id", flat=True).first()
        if anchor is None:
            # A cursor the schema allows (any id) that names nothing here: not found, like the object itself.
            raise ObjectNotFound(f"after: no object with id {after!r} in this list.", fields={"after": ["Unknown id."]})
        rows = rows.filter(id__lt=anchor)
    items = list(rows[: limit + 1])
    return CursorPage(items=items[:limit], has_more=len(items) > limit)
