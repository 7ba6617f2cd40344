from dataclasses import dataclass

from django.db.models import Count, Sum

from controlplane.common.errors import InvalidInput, ObjectNotFound
from controlplane.responses.models import StoredResponse
from controlplane.tenancy.models import Organization
from controlplane.tenancy.scoping import organization_rows

MAX_PAGE = 100


@dataclass(frozen=True)
class ResponseStorage:
    """What an organization's stored responses take."""

    responses: int
    bytes: int


@dataclass(frozen=True)
class ItemPage:
    """One page of a response's input items: `after` the item whose id the last page ended with."""

    items: list[dict]
    has_more: bool


def response_get(*, organization: Organization, public_id: str) -> StoredResponse:
    """The organization's stored response; another organization's is not found, as a missing one is."""
    response = organization_rows(StoredResponse, organization=organization).filter(public_id=public_id).first()
    if response is None:
        raise ObjectNotFound(f"No stored response with id {public_id!r}.")
    return response


def response_status_get(*, organization: Organization, public_id: str) -> str:
    status = (
        organization_rows(StoredResponse, organization=organization)
        .filter(public_id=public_id)
        .values_list("status", flat=True)
        .first()
    )
    if status is None:
        raise ObjectNotFound(f"No stored response with id {public_id!r}.")
    return status


def input_item_page(*, response: StoredResponse, after: str | None, limit: int, order: str) -> ItemPage:
    """`limit` of the response's input items, newest first (`desc`, OpenAI's default) or oldest first (`asc`)."""
    items = list(response.input_items) if order == "asc" else list(reversed(response.input_items))
    if after:
        ids = [item.get("id") for item in items]
        if after not in ids:
            message = f"after: no input item with id {after!r} in this response."
            raise InvalidInput(message, fields={"after": ["Unknown id."]})
        items = items[ids.index(after) + 1 :]
    return ItemPage(items=items[:limit], has_more=len(items) > limit)


def response_storage(*, organization: Organization) -> ResponseStorage:
    totals = organization_rows(StoredResponse, organization=organization).aggregate(
        responses=Count("id"), bytes=Sum("size_bytes", default=0)
    )
    return ResponseStorage(**totals)
