"""The admin sub-client: usage, billing, spend limit, rate limits, API keys and invoices over the control plane's
REST API.

The client's API key must carry the admin:read scope (admin:write to create or revoke keys and set the
spend limit). The asyncio twins run each call in a worker thread.
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Awaitable, Callable, Mapping, Sequence
from datetime import date, datetime
from functools import cached_property, partial
from typing import Generic, TypeVar
from urllib.parse import quote

from .._admin_convert import (
    api_key_from_json,
    api_key_limits_from_json,
    billing_summary_from_json,
    daily_usage_from_json,
    invoice_from_json,
    organization_limits_from_json,
    page_from_json,
    spend_limit_from_json,
)
from .._response import async_to_raw_response_wrapper, to_raw_response_wrapper
from ..types import (
    NOT_GIVEN,
    ApiKey,
    ApiKeyLimits,
    AsyncPage,
    BillingSummary,
    DailyUsage,
    Invoice,
    NotGiven,
    OrganizationLimits,
    Page,
    SpendLimit,
    UsageGroupBy,
)
from ._connections import ControlPlaneConnection

__all__ = ["Admin", "AsyncAdmin"]

_GROUPS = ("phase", "model", "api_key")

R = TypeVar("R")
T = TypeVar("T")


class _Resource:
    def __init__(self, client: ControlPlaneConnection) -> None:
        self._client = client

    def _request(
        self, method: str, path: str, *, query: Mapping[str, object] | None = None, body: object = None
    ) -> object:
        client = self._client
        return client._admin_transport.request(
            method, path, query=query, body=body, timeout=client.timeout, max_retries=client.max_retries
        )


class Usage(_Resource):
    @cached_property
    def with_raw_response(self) -> UsageWithRawResponse:
        return UsageWithRawResponse(self)

    def daily(self, *, start: date | str, end: date | str, group_by: UsageGroupBy = "phase") -> list[DailyUsage]:
        """Tokens and cost per day from `start` to `end` (inclusive), grouped by phase, model or API key."""
        if group_by not in _GROUPS:
            raise ValueError(f"group_by must be one of {', '.join(_GROUPS)}, not {group_by!r}")
        query = {"start": _day(start), "end": _day(end), "group_by": group_by}
        return daily_usage_from_json(self._request("GET", "/usage/daily", query=query))


class Billing(_Resource):
    @cached_property
    def with_raw_response(self) -> BillingWithRawResponse:
        return BillingWithRawResponse(self)

    def current(self) -> BillingSummary:
        """The current period: amount to date, projection, spend limit and the alerts it triggered."""
        return billing_summary_from_json(self._request("GET", "/billing/current"))


class SpendLimits(_Resource):
    @cached_property
    def with_raw_response(self) -> SpendLimitsWithRawResponse:
        return SpendLimitsWithRawResponse(self)

    def retrieve(self) -> SpendLimit:
        return spend_limit_from_json(self._request("GET", "/spend-limit"))

    def update(self, *, limit_micros: int | None) -> SpendLimit:
        """Sets the limit for a billing period in micro-dollars; None removes it."""
        if limit_micros is not None and (
            isinstance(limit_micros, bool) or not isinstance(limit_micros, int) or limit_micros < 0
        ):
            raise ValueError(f"limit_micros must be a non-negative integer or None, not {limit_micros!r}")
        return spend_limit_from_json(self._request("PUT", "/spend-limit", body={"limit_micros": limit_micros}))


class Limits(_Resource):
    """Per-minute rate limits of the organization and of each API key (None: unlimited). Anyone in the
    organization reads them; setting them needs the admin:write scope. The gateway applies a change
    within its key cache time (5 s)."""

    @cached_property
    def with_raw_response(self) -> LimitsWithRawResponse:
        return LimitsWithRawResponse(self)

    def retrieve(self) -> OrganizationLimits:
        return organization_limits_from_json(self._request("GET", "/limits"))

    def update(
        self,
        *,
        requests_per_minute: int | None | NotGiven = NOT_GIVEN,
        input_tokens_per_minute: int | None | NotGiven = NOT_GIVEN,
        output_tokens_per_minute: int | None | NotGiven = NOT_GIVEN,
    ) -> OrganizationLimits:
        """Sets the limits given (None makes one unlimited) and leaves the others as they are."""
        body = _limit_changes(requests_per_minute, input_tokens_per_minute, output_tokens_per_minute)
        return organization_limits_from_json(self._request("PATCH", "/limits", body=body))

    def retrieve_key(self, key_id: str) -> ApiKeyLimits:
        return api_key_limits_from_json(self._request("GET", f"/api-keys/{_segment(key_id)}/limits"))

    def update_key(
        self,
        key_id: str,
        *,
        requests_per_minute: int | None | NotGiven = NOT_GIVEN,
        input_tokens_per_minute: int | None | NotGiven = NOT_GIVEN,
        output_tokens_per_minute: int | None | NotGiven = NOT_GIVEN,
    ) -> ApiKeyLimits:
        """Sets the key's limits given (None makes one unlimited) and leaves the others as they are."""
        body = _limit_changes(requests_per_minute, input_tokens_per_minute, output_tokens_per_minute)
        return api_key_limits_from_json(self._request("PATCH", f"/api-keys/{_segment(key_id)}/limits", body=body))


def _limit_changes(requests: object, input_tokens: object, output_tokens: object) -> dict[str, int | None]:
    given = {
        "requests_per_minute": requests,
        "input_tokens_per_minute": input_tokens,
        "output_tokens_per_minute": output_tokens,
    }
    changes: dict[str, int | None] = {}
    for name, value in given.items():
        if isinstance(value, NotGiven):
            continue
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 0):
            raise ValueError(f"{name} must be a non-negative integer or None (unlimited), not {value!r}")
        changes[name] = value
    if not changes:
        raise ValueError(f"give at least one of {', '.join(given)}")
    return changes


class ApiKeys(_Resource):
    @cached_property
    def with_raw_response(self) -> ApiKeysWithRawResponse:
        return ApiKeysWithRawResponse(self)

    def list(self, *, limit: int | None = None, offset: int | None = None) -> Page[ApiKey]:
        """A page of keys; iterating it walks all of them, fetching the next pages as it goes."""
        body = self._request("GET", "/api-keys", query={"limit": limit, "offset": offset})
        return _offset_page(page_from_json(body, api_key_from_json), self.list, limit, offset)

    def create(self, *, name: str, scopes: Sequence[str] | None = None, expires_at: datetime | None = None) -> ApiKey:
        """Issues a key; the returned object's `key` is the secret, shown this once."""
        body: dict[str, object] = {"name": name, "expires_at": expires_at.isoformat() if expires_at else None}
        if scopes is not None:
            body["scopes"] = list(scopes)
        return api_key_from_json(self._request("POST", "/api-keys", body=body))

    def retrieve(self, key_id: str) -> ApiKey:
        return api_key_from_json(self._request("GET", f"/api-keys/{_segment(key_id)}"))

    def revoke(self, key_id: str) -> ApiKey:
        """Revokes the key at once; the gateway refuses it within seconds."""
        return api_key_from_json(self._request("POST", f"/api-keys/{_segment(key_id)}/revoke"))


class Invoices(_Resource):
    @cached_property
    def with_raw_response(self) -> InvoicesWithRawResponse:
        return InvoicesWithRawResponse(self)

    def list(self, *, limit: int | None = None, offset: int | None = None) -> Page[Invoice]:
        """A page of invoices; iterating it walks all of them, fetching the next pages as it goes."""
        body = self._request("GET", "/invoices", query={"limit": limit, "offset": offset})
        return _offset_page(page_from_json(body, invoice_from_json), self.list, limit, offset)

    def retrieve(self, invoice_id: str) -> Invoice:
        return invoice_from_json(self._request("GET", f"/invoices/{_segment(invoice_id)}"))


class Admin:
    def __init__(self, client: ControlPlaneConnection) -> None:
        self.usage = Usage(client)
        self.billing = Billing(client)
        self.spend_limit = SpendLimits(client)
        self.api_keys = ApiKeys(client)
        self.invoices = Invoices(client)
        self.limits = Limits(client)


class _AsyncResource(Generic[R]):
    """Runs the sync resource's methods in a worker thread."""

    def __init__(self, sync_resource: R) -> None:
        self._sync = sync_resource


class AsyncUsage(_AsyncResource[Usage]):
    @cached_property
    def with_raw_response(self) -> AsyncUsageWithRawResponse:
        return AsyncUsageWithRawResponse(self)

    async def daily(self, *, start: date | str, end: date | str, group_by: UsageGroupBy = "phase") -> list[DailyUsage]:
        return await asyncio.to_thread(self._sync.daily, start=start, end=end, group_by=group_by)


class AsyncBilling(_AsyncResource[Billing]):
    @cached_property
    def with_raw_response(self) -> AsyncBillingWithRawResponse:
        return AsyncBillingWithRawResponse(self)

    async def current(self) -> BillingSummary:
        return await asyncio.to_thread(self._sync.current)


class AsyncSpendLimits(_AsyncResource[SpendLimits]):
    @cached_property
    def with_raw_response(self) -> AsyncSpendLimitsWithRawResponse:
        return AsyncSpendLimitsWithRawResponse(self)

    async def retrieve(self) -> SpendLimit:
        return await asyncio.to_thread(self._sync.retrieve)

    async def update(self, *, limit_micros: int | None) -> SpendLimit:
        return await asyncio.to_thread(self._sync.update, limit_micros=limit_micros)


class AsyncLimits(_AsyncResource[Limits]):
    @cached_property
    def with_raw_response(self) -> AsyncLimitsWithRawResponse:
        return AsyncLimitsWithRawResponse(self)

    async def retrieve(self) -> OrganizationLimits:
        return await asyncio.to_thread(self._sync.retrieve)

    async def update(
        self,
        *,
        requests_per_minute: int | None | NotGiven = NOT_GIVEN,
        input_tokens_per_minute: int | None | NotGiven = NOT_GIVEN,
        output_tokens_per_minute: int | None | NotGiven = NOT_GIVEN,
    ) -> OrganizationLimits:
        return await asyncio.to_thread(
            self._sync.update,
            requests_per_minute=requests_per_minute,
            input_tokens_per_minute=input_tokens_per_minute,
            output_tokens_per_minute=output_tokens_per_minute,
        )

    async def retrieve_key(self, key_id: str) -> ApiKeyLimits:
        return await asyncio.to_thread(self._sync.retrieve_key, key_id)

    async def update_key(
        self,
        key_id: str,
        *,
        requests_per_minute: int | None | NotGiven = NOT_GIVEN,
        input_tokens_per_minute: int | None | NotGiven = NOT_GIVEN,
        output_tokens_per_minute: int | None | NotGiven = NOT_GIVEN,
    ) -> ApiKeyLimits:
        return await asyncio.to_thread(
            self._sync.update_key,
            key_id,
            requests_per_minute=requests_per_minute,
            input_tokens_per_minute=input_tokens_per_minute,
            output_tokens_per_minute=output_tokens_per_minute,
        )


class AsyncApiKeys(_AsyncResource[ApiKeys]):
    @cached_property
    def with_raw_response(self) -> AsyncApiKeysWithRawResponse:
        return AsyncApiKeysWithRawResponse(self)

    async def list(self, *, limit: int | None = None, offset: int | None = None) -> AsyncPage[ApiKey]:
        """A page of keys; `async for` over it walks all of them, fetching the next pages as it goes."""
        page = await asyncio.to_thread(self._sync.list, limit=limit, offset=offset)
        return _async_offset_page(page, self.list, limit, offset)

    async def create(
        self, *, name: str, scopes: Sequence[str] | None = None, expires_at: datetime | None = None
    ) -> ApiKey:
        return await asyncio.to_thread(self._sync.create, name=name, scopes=scopes, expires_at=expires_at)

    async def retrieve(self, key_id: str) -> ApiKey:
        return await asyncio.to_thread(self._sync.retrieve, key_id)

    async def revoke(self, key_id: str) -> ApiKey:
        return await asyncio.to_thread(self._sync.revoke, key_id)


class AsyncInvoices(_AsyncResource[Invoices]):
    @cached_property
    def with_raw_response(self) -> AsyncInvoicesWithRawResponse:
        return AsyncInvoicesWithRawResponse(self)

    async def list(self, *, limit: int | None = None, offset: int | None = None) -> AsyncPage[Invoice]:
        """A page of invoices; `async for` over it walks all of them, fetching the next pages as it goes."""
        page = await asyncio.to_thread(self._sync.list, limit=limit, offset=offset)
        return _async_offset_page(page, self.list, limit, offset)

    async def retrieve(self, invoice_id: str) -> Invoice:
        return await asyncio.to_thread(self._sync.retrieve, invoice_id)


class AsyncAdmin:
    def __init__(self, client: ControlPlaneConnection) -> None:
        sync = Admin(client)
        self.usage = AsyncUsage(sync.usage)
        self.billing = AsyncBilling(sync.billing)
        self.spend_limit = AsyncSpendLimits(sync.spend_limit)
        self.api_keys = AsyncApiKeys(sync.api_keys)
        self.invoices = AsyncInvoices(sync.invoices)
        self.limits = AsyncLimits(sync.limits)


def _offset_page(page: Page[T], fetch: Callable[..., Page[T]], limit: int | None, offset: int | None) -> Page[T]:
    """The page, knowing how to fetch the one after it: the same limit, from where this one ended."""
    following = partial(fetch, limit=limit, offset=(offset or 0) + len(page.data))
    return dataclasses.replace(page, _next_page=following)


def _async_offset_page(
    page: Page[T], fetch: Callable[..., Awaitable[AsyncPage[T]]], limit: int | None, offset: int | None
) -> AsyncPage[T]:
    following = partial(fetch, limit=limit, offset=(offset or 0) + len(page.data))
    return AsyncPage(data=page.data, has_more=page.has_more, total=page.total, _next_page=following)


def _day(value: date | str) -> str:
    if isinstance(value, date):
        return value.isoformat()[:10]
    try:
        return date.fromisoformat(value).isoformat()
    except (TypeError, ValueError):
        raise ValueError(f"expected a date or 'YYYY-MM-DD', not {value!r}") from None


def _segment(identifier: str) -> str:
    if not isinstance(identifier, str) or not identifier:
        raise ValueError(f"expected a non-empty id, not {identifier!r}")
    return quote(identifier, safe="")


class UsageWithRawResponse:
    def __init__(self, resource: Usage) -> None:
        self.daily = to_raw_response_wrapper(resource.daily)


class BillingWithRawResponse:
    def __init__(self, resource: Billing) -> None:
        self.current = to_raw_response_wrapper(resource.current)


class SpendLimitsWithRawResponse:
    def __init__(self, resource: SpendLimits) -> None:
        self.retrieve = to_raw_response_wrapper(resource.retrieve)
        self.update = to_raw_response_wrapper(resource.update)


class LimitsWithRawResponse:
    def __init__(self, resource: Limits) -> None:
        self.retrieve = to_raw_response_wrapper(resource.retrieve)
        self.update = to_raw_response_wrapper(resource.update)
        self.retrieve_key = to_raw_response_wrapper(resource.retrieve_key)
        self.update_key = to_raw_response_wrapper(resource.update_key)


class ApiKeysWithRawResponse:
    def __init__(self, resource: ApiKeys) -> None:
        self.list = to_raw_response_wrapper(resource.list)
        self.create = to_raw_response_wrapper(resource.create)
        self.retrieve = to_raw_response_wrapper(resource.retrieve)
        self.revoke = to_raw_response_wrapper(resource.revoke)


class InvoicesWithRawResponse:
    def __init__(self, resource: Invoices) -> None:
        self.list = to_raw_response_wrapper(resource.list)
        self.retrieve = to_raw_response_wrapper(resource.retrieve)


class AsyncUsageWithRawResponse:
    def __init__(self, resource: AsyncUsage) -> None:
        self.daily = async_to_raw_response_wrapper(resource.daily)


class AsyncBillingWithRawResponse:
    def __init__(self, resource: AsyncBilling) -> None:
        self.current = async_to_raw_response_wrapper(resource.current)


class AsyncSpendLimitsWithRawResponse:
    def __init__(self, resource: AsyncSpendLimits) -> None:
        self.retrieve = async_to_raw_response_wrapper(resource.retrieve)
        self.update = async_to_raw_response_wrapper(resource.update)


class AsyncLimitsWithRawResponse:
    def __init__(self, resource: AsyncLimits) -> None:
        self.retrieve = async_to_raw_response_wrapper(resource.retrieve)
        self.update = async_to_raw_response_wrapper(resource.update)
        self.retrieve_key = async_to_raw_response_wrapper(resource.retrieve_key)
        self.update_key = async_to_raw_response_wrapper(resource.update_key)


class AsyncApiKeysWithRawResponse:
    def __init__(self, resource: AsyncApiKeys) -> None:
        self.list = async_to_raw_response_wrapper(resource.list)
        self.create = async_to_raw_response_wrapper(resource.create)
        self.retrieve = async_to_raw_response_wrapper(resource.retrieve)
        self.revoke = async_to_raw_response_wrapper(resource.revoke)


class AsyncInvoicesWithRawResponse:
    def __init__(self, resource: AsyncInvoices) -> None:
        self.list = async_to_raw_response_wrapper(resource.list)
        self.retrieve = async_to_raw_response_wrapper(resource.retrieve)
