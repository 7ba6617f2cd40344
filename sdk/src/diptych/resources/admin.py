"""The admin sub-client: usage, billing, spend limit, rate limits, API keys and invoices over the control plane's
REST API.

The client's API key must carry the admin:read scope (admin:write to create or revoke keys and set the
spend limit). Every method takes the per-call options (`timeout`, `extra_headers`, `extra_query`, `extra_body`;
`idempotency_key` too on a POST). The asyncio twins run each call in a worker thread.
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Awaitable, Callable, Sequence
from datetime import date, datetime
from functools import cached_property, partial
from typing import Any, Generic, TypeVar, Unpack

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
from .._http import json_body
from .._response import (
    StreamedAPIResponse,
    async_to_raw_response_wrapper,
    async_to_streamed_response_wrapper,
    then,
    to_raw_response_wrapper,
    to_streamed_response_wrapper,
)
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
    PostRequestOptions,
    RequestOptions,
    SpendLimit,
    UsageGroupBy,
)
from ._connections import ControlPlaneConnection
from ._control_plane import ControlPlaneResource, from_json
from ._keyword_parameters import KeywordParameters
from ._paths import segment

__all__ = ["Admin", "AsyncAdmin"]

_GROUPS = ("phase", "model", "api_key")
_OPTIONS = KeywordParameters(RequestOptions)
_POST_OPTIONS = KeywordParameters(PostRequestOptions)

R = TypeVar("R")
T = TypeVar("T")


class Usage(ControlPlaneResource):
    @cached_property
    def with_raw_response(self) -> UsageWithRawResponse:
        return UsageWithRawResponse(self)

    @cached_property
    def with_streaming_response(self) -> UsageWithStreamingResponse:
        return UsageWithStreamingResponse(self)

    @_OPTIONS.expand
    def daily(
        self,
        *,
        start: date | str,
        end: date | str,
        group_by: UsageGroupBy = "phase",
        **options: Unpack[RequestOptions],
    ) -> list[DailyUsage]:
        """Tokens and cost per day from `start` to `end` (inclusive), grouped by phase, model or API key."""
        if group_by not in _GROUPS:
            raise ValueError(f"group_by must be one of {', '.join(_GROUPS)}, not {group_by!r}")
        query = {"start": _day(start), "end": _day(end), "group_by": group_by}
        return self._request(
            "GET", "/usage/daily", from_json(daily_usage_from_json), _OPTIONS.complete(options), query=query
        )


class Billing(ControlPlaneResource):
    @cached_property
    def with_raw_response(self) -> BillingWithRawResponse:
        return BillingWithRawResponse(self)

    @cached_property
    def with_streaming_response(self) -> BillingWithStreamingResponse:
        return BillingWithStreamingResponse(self)

    @_OPTIONS.expand
    def current(self, **options: Unpack[RequestOptions]) -> BillingSummary:
        """The current period: amount to date, projection, spend limit and the alerts it triggered."""
        return self._request(
            "GET", "/billing/current", from_json(billing_summary_from_json), _OPTIONS.complete(options)
        )


class SpendLimits(ControlPlaneResource):
    @cached_property
    def with_raw_response(self) -> SpendLimitsWithRawResponse:
        return SpendLimitsWithRawResponse(self)

    @cached_property
    def with_streaming_response(self) -> SpendLimitsWithStreamingResponse:
        return SpendLimitsWithStreamingResponse(self)

    @_OPTIONS.expand
    def retrieve(self, **options: Unpack[RequestOptions]) -> SpendLimit:
        return self._request("GET", "/spend-limit", from_json(spend_limit_from_json), _OPTIONS.complete(options))

    @_OPTIONS.expand
    def update(self, *, limit_micros: int | None, **options: Unpack[RequestOptions]) -> SpendLimit:
        """Sets the limit for a billing period in micro-dollars; None removes it."""
        if limit_micros is not None and (
            isinstance(limit_micros, bool) or not isinstance(limit_micros, int) or limit_micros < 0
        ):
            raise ValueError(f"limit_micros must be a non-negative integer or None, not {limit_micros!r}")
        body = {"limit_micros": limit_micros}
        return self._request(
            "PUT", "/spend-limit", from_json(spend_limit_from_json), _OPTIONS.complete(options), body=body
        )


class Limits(ControlPlaneResource):
    """Per-minute rate limits of the organization and of each API key (None: unlimited). Anyone in the
    organization reads them; setting them needs the admin:write scope. The gateway applies a change
    within its key cache time (5 s)."""

    @cached_property
    def with_raw_response(self) -> LimitsWithRawResponse:
        return LimitsWithRawResponse(self)

    @cached_property
    def with_streaming_response(self) -> LimitsWithStreamingResponse:
        return LimitsWithStreamingResponse(self)

    @_OPTIONS.expand
    def retrieve(self, **options: Unpack[RequestOptions]) -> OrganizationLimits:
        return self._request("GET", "/limits", from_json(organization_limits_from_json), _OPTIONS.complete(options))

    @_OPTIONS.expand
    def update(
        self,
        *,
        requests_per_minute: int | NotGiven | None = NOT_GIVEN,
        input_tokens_per_minute: int | NotGiven | None = NOT_GIVEN,
        output_tokens_per_minute: int | NotGiven | None = NOT_GIVEN,
        **options: Unpack[RequestOptions],
    ) -> OrganizationLimits:
        """Sets the limits given (None makes one unlimited) and leaves the others as they are."""
        body = _limit_changes(requests_per_minute, input_tokens_per_minute, output_tokens_per_minute)
        return self._request(
            "PATCH", "/limits", from_json(organization_limits_from_json), _OPTIONS.complete(options), body=body
        )

    @_OPTIONS.expand
    def retrieve_key(self, key_id: str, **options: Unpack[RequestOptions]) -> ApiKeyLimits:
        path = f"/api-keys/{segment(key_id)}/limits"
        return self._request("GET", path, from_json(api_key_limits_from_json), _OPTIONS.complete(options))

    @_OPTIONS.expand
    def update_key(
        self,
        key_id: str,
        *,
        requests_per_minute: int | NotGiven | None = NOT_GIVEN,
        input_tokens_per_minute: int | NotGiven | None = NOT_GIVEN,
        output_tokens_per_minute: int | NotGiven | None = NOT_GIVEN,
        **options: Unpack[RequestOptions],
    ) -> ApiKeyLimits:
        """Sets the key's limits given (None makes one unlimited) and leaves the others as they are."""
        body = _limit_changes(requests_per_minute, input_tokens_per_minute, output_tokens_per_minute)
        path = f"/api-keys/{segment(key_id)}/limits"
        return self._request("PATCH", path, from_json(api_key_limits_from_json), _OPTIONS.complete(options), body=body)


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


class ApiKeys(ControlPlaneResource):
    @cached_property
    def with_raw_response(self) -> ApiKeysWithRawResponse:
        return ApiKeysWithRawResponse(self)

    @cached_property
    def with_streaming_response(self) -> ApiKeysWithStreamingResponse:
        return ApiKeysWithStreamingResponse(self)

    @_OPTIONS.expand
    def list(
        self, *, limit: int | None = None, offset: int | None = None, **options: Unpack[RequestOptions]
    ) -> Page[ApiKey]:
        """A page of keys; iterating it walks all of them, fetching the next pages as it goes."""
        options = _OPTIONS.complete(options)

        def parse(response: StreamedAPIResponse[Any]) -> Page[ApiKey]:
            page = page_from_json(json_body(response), api_key_from_json)
            return _offset_page(page, self.list, limit, offset, options)

        return self._request("GET", "/api-keys", parse, options, query={"limit": limit, "offset": offset})

    @_POST_OPTIONS.expand
    def create(
        self,
        *,
        name: str,
        scopes: Sequence[str] | None = None,
        expires_at: datetime | None = None,
        project_id: str | None = None,
        **options: Unpack[PostRequestOptions],
    ) -> ApiKey:
        """Issues a key, in `project_id` (by default the organization's default project); the returned
        object's `key` is the secret, shown this once."""
        body: dict[str, object] = {"name": name, "expires_at": expires_at.isoformat() if expires_at else None}
        if scopes is not None:
            body["scopes"] = list(scopes)
        if project_id is not None:
            body["project_id"] = project_id
        return self._request(
            "POST", "/api-keys", from_json(api_key_from_json), _POST_OPTIONS.complete(options), body=body
        )

    @_OPTIONS.expand
    def retrieve(self, key_id: str, **options: Unpack[RequestOptions]) -> ApiKey:
        path = f"/api-keys/{segment(key_id)}"
        return self._request("GET", path, from_json(api_key_from_json), _OPTIONS.complete(options))

    @_POST_OPTIONS.expand
    def revoke(self, key_id: str, **options: Unpack[PostRequestOptions]) -> ApiKey:
        """Revokes the key at once; the gateway refuses it within seconds."""
        path = f"/api-keys/{segment(key_id)}/revoke"
        return self._request("POST", path, from_json(api_key_from_json), _POST_OPTIONS.complete(options))


class Invoices(ControlPlaneResource):
    @cached_property
    def with_raw_response(self) -> InvoicesWithRawResponse:
        return InvoicesWithRawResponse(self)

    @cached_property
    def with_streaming_response(self) -> InvoicesWithStreamingResponse:
        return InvoicesWithStreamingResponse(self)

    @_OPTIONS.expand
    def list(
        self, *, limit: int | None = None, offset: int | None = None, **options: Unpack[RequestOptions]
    ) -> Page[Invoice]:
        """A page of invoices; iterating it walks all of them, fetching the next pages as it goes."""
        options = _OPTIONS.complete(options)

        def parse(response: StreamedAPIResponse[Any]) -> Page[Invoice]:
            page = page_from_json(json_body(response), invoice_from_json)
            return _offset_page(page, self.list, limit, offset, options)

        return self._request("GET", "/invoices", parse, options, query={"limit": limit, "offset": offset})

    @_OPTIONS.expand
    def retrieve(self, invoice_id: str, **options: Unpack[RequestOptions]) -> Invoice:
        path = f"/invoices/{segment(invoice_id)}"
        return self._request("GET", path, from_json(invoice_from_json), _OPTIONS.complete(options))


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

    @cached_property
    def with_streaming_response(self) -> AsyncUsageWithStreamingResponse:
        return AsyncUsageWithStreamingResponse(self)

    @_OPTIONS.expand
    async def daily(
        self,
        *,
        start: date | str,
        end: date | str,
        group_by: UsageGroupBy = "phase",
        **options: Unpack[RequestOptions],
    ) -> list[DailyUsage]:
        return await asyncio.to_thread(partial(self._sync.daily, start=start, end=end, group_by=group_by, **options))


class AsyncBilling(_AsyncResource[Billing]):
    @cached_property
    def with_raw_response(self) -> AsyncBillingWithRawResponse:
        return AsyncBillingWithRawResponse(self)

    @cached_property
    def with_streaming_response(self) -> AsyncBillingWithStreamingResponse:
        return AsyncBillingWithStreamingResponse(self)

    @_OPTIONS.expand
    async def current(self, **options: Unpack[RequestOptions]) -> BillingSummary:
        return await asyncio.to_thread(partial(self._sync.current, **options))


class AsyncSpendLimits(_AsyncResource[SpendLimits]):
    @cached_property
    def with_raw_response(self) -> AsyncSpendLimitsWithRawResponse:
        return AsyncSpendLimitsWithRawResponse(self)

    @cached_property
    def with_streaming_response(self) -> AsyncSpendLimitsWithStreamingResponse:
        return AsyncSpendLimitsWithStreamingResponse(self)

    @_OPTIONS.expand
    async def retrieve(self, **options: Unpack[RequestOptions]) -> SpendLimit:
        return await asyncio.to_thread(partial(self._sync.retrieve, **options))

    @_OPTIONS.expand
    async def update(self, *, limit_micros: int | None, **options: Unpack[RequestOptions]) -> SpendLimit:
        return await asyncio.to_thread(partial(self._sync.update, limit_micros=limit_micros, **options))


class AsyncLimits(_AsyncResource[Limits]):
    @cached_property
    def with_raw_response(self) -> AsyncLimitsWithRawResponse:
        return AsyncLimitsWithRawResponse(self)

    @cached_property
    def with_streaming_response(self) -> AsyncLimitsWithStreamingResponse:
        return AsyncLimitsWithStreamingResponse(self)

    @_OPTIONS.expand
    async def retrieve(self, **options: Unpack[RequestOptions]) -> OrganizationLimits:
        return await asyncio.to_thread(partial(self._sync.retrieve, **options))

    @_OPTIONS.expand
    async def update(
        self,
        *,
        requests_per_minute: int | NotGiven | None = NOT_GIVEN,
        input_tokens_per_minute: int | NotGiven | None = NOT_GIVEN,
        output_tokens_per_minute: int | NotGiven | None = NOT_GIVEN,
        **options: Unpack[RequestOptions],
    ) -> OrganizationLimits:
        return await asyncio.to_thread(
            partial(
                self._sync.update,
                requests_per_minute=requests_per_minute,
                input_tokens_per_minute=input_tokens_per_minute,
                output_tokens_per_minute=output_tokens_per_minute,
                **options,
            )
        )

    @_OPTIONS.expand
    async def retrieve_key(self, key_id: str, **options: Unpack[RequestOptions]) -> ApiKeyLimits:
        return await asyncio.to_thread(partial(self._sync.retrieve_key, key_id, **options))

    @_OPTIONS.expand
    async def update_key(
        self,
        key_id: str,
        *,
        requests_per_minute: int | NotGiven | None = NOT_GIVEN,
        input_tokens_per_minute: int | NotGiven | None = NOT_GIVEN,
        output_tokens_per_minute: int | NotGiven | None = NOT_GIVEN,
        **options: Unpack[RequestOptions],
    ) -> ApiKeyLimits:
        return await asyncio.to_thread(
            partial(
                self._sync.update_key,
                key_id,
                requests_per_minute=requests_per_minute,
                input_tokens_per_minute=input_tokens_per_minute,
                output_tokens_per_minute=output_tokens_per_minute,
                **options,
            )
        )


class AsyncApiKeys(_AsyncResource[ApiKeys]):
    @cached_property
    def with_raw_response(self) -> AsyncApiKeysWithRawResponse:
        return AsyncApiKeysWithRawResponse(self)

    @cached_property
    def with_streaming_response(self) -> AsyncApiKeysWithStreamingResponse:
        return AsyncApiKeysWithStreamingResponse(self)

    @_OPTIONS.expand
    async def list(
        self, *, limit: int | None = None, offset: int | None = None, **options: Unpack[RequestOptions]
    ) -> AsyncPage[ApiKey]:
        """A page of keys; `async for` over it walks all of them, fetching the next pages as it goes."""
        page = await asyncio.to_thread(partial(self._sync.list, limit=limit, offset=offset, **options))
        return then(page, lambda page: _async_offset_page(page, self.list, limit, offset, options))

    @_POST_OPTIONS.expand
    async def create(
        self,
        *,
        name: str,
        scopes: Sequence[str] | None = None,
        expires_at: datetime | None = None,
        project_id: str | None = None,
        **options: Unpack[PostRequestOptions],
    ) -> ApiKey:
        return await asyncio.to_thread(
            partial(
                self._sync.create, name=name, scopes=scopes, expires_at=expires_at, project_id=project_id, **options
            )
        )

    @_OPTIONS.expand
    async def retrieve(self, key_id: str, **options: Unpack[RequestOptions]) -> ApiKey:
        return await asyncio.to_thread(partial(self._sync.retrieve, key_id, **options))

    @_POST_OPTIONS.expand
    async def revoke(self, key_id: str, **options: Unpack[PostRequestOptions]) -> ApiKey:
        return await asyncio.to_thread(partial(self._sync.revoke, key_id, **options))


class AsyncInvoices(_AsyncResource[Invoices]):
    @cached_property
    def with_raw_response(self) -> AsyncInvoicesWithRawResponse:
        return AsyncInvoicesWithRawResponse(self)

    @cached_property
    def with_streaming_response(self) -> AsyncInvoicesWithStreamingResponse:
        return AsyncInvoicesWithStreamingResponse(self)

    @_OPTIONS.expand
    async def list(
        self, *, limit: int | None = None, offset: int | None = None, **options: Unpack[RequestOptions]
    ) -> AsyncPage[Invoice]:
        """A page of invoices; `async for` over it walks all of them, fetching the next pages as it goes."""
        page = await asyncio.to_thread(partial(self._sync.list, limit=limit, offset=offset, **options))
        return then(page, lambda page: _async_offset_page(page, self.list, limit, offset, options))

    @_OPTIONS.expand
    async def retrieve(self, invoice_id: str, **options: Unpack[RequestOptions]) -> Invoice:
        return await asyncio.to_thread(partial(self._sync.retrieve, invoice_id, **options))


class AsyncAdmin:
    def __init__(self, client: ControlPlaneConnection) -> None:
        sync = Admin(client)
        self.usage = AsyncUsage(sync.usage)
        self.billing = AsyncBilling(sync.billing)
        self.spend_limit = AsyncSpendLimits(sync.spend_limit)
        self.api_keys = AsyncApiKeys(sync.api_keys)
        self.invoices = AsyncInvoices(sync.invoices)
        self.limits = AsyncLimits(sync.limits)


def _offset_page(
    page: Page[T], fetch: Callable[..., Page[T]], limit: int | None, offset: int | None, options: RequestOptions
) -> Page[T]:
    """The page, knowing how to fetch the one after it: the same limit and options, from where this one ended."""
    following = partial(fetch, limit=limit, offset=(offset or 0) + len(page.data), **options)
    return dataclasses.replace(page, _next_page=following)


def _async_offset_page(
    page: Page[T],
    fetch: Callable[..., Awaitable[AsyncPage[T]]],
    limit: int | None,
    offset: int | None,
    options: RequestOptions,
) -> AsyncPage[T]:
    following = partial(fetch, limit=limit, offset=(offset or 0) + len(page.data), **options)
    return AsyncPage(data=page.data, has_more=page.has_more, total=page.total, _next_page=following)


def _day(value: date | str) -> str:
    if isinstance(value, date):
        return value.isoformat()[:10]
    try:
        return date.fromisoformat(value).isoformat()
    except (TypeError, ValueError):
        raise ValueError(f"expected a date or 'YYYY-MM-DD', not {value!r}") from None


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


class UsageWithStreamingResponse:
    def __init__(self, resource: Usage) -> None:
        self.daily = to_streamed_response_wrapper(resource.daily)


class BillingWithStreamingResponse:
    def __init__(self, resource: Billing) -> None:
        self.current = to_streamed_response_wrapper(resource.current)


class SpendLimitsWithStreamingResponse:
    def __init__(self, resource: SpendLimits) -> None:
        self.retrieve = to_streamed_response_wrapper(resource.retrieve)
        self.update = to_streamed_response_wrapper(resource.update)


class LimitsWithStreamingResponse:
    def __init__(self, resource: Limits) -> None:
        self.retrieve = to_streamed_response_wrapper(resource.retrieve)
        self.update = to_streamed_response_wrapper(resource.update)
        self.retrieve_key = to_streamed_response_wrapper(resource.retrieve_key)
        self.update_key = to_streamed_response_wrapper(resource.update_key)


class ApiKeysWithStreamingResponse:
    def __init__(self, resource: ApiKeys) -> None:
        self.list = to_streamed_response_wrapper(resource.list)
        self.create = to_streamed_response_wrapper(resource.create)
        self.retrieve = to_streamed_response_wrapper(resource.retrieve)
        self.revoke = to_streamed_response_wrapper(resource.revoke)


class InvoicesWithStreamingResponse:
    def __init__(self, resource: Invoices) -> None:
        self.list = to_streamed_response_wrapper(resource.list)
        self.retrieve = to_streamed_response_wrapper(resource.retrieve)


class AsyncUsageWithStreamingResponse:
    def __init__(self, resource: AsyncUsage) -> None:
        self.daily = async_to_streamed_response_wrapper(resource.daily)


class AsyncBillingWithStreamingResponse:
    def __init__(self, resource: AsyncBilling) -> None:
        self.current = async_to_streamed_response_wrapper(resource.current)


class AsyncSpendLimitsWithStreamingResponse:
    def __init__(self, resource: AsyncSpendLimits) -> None:
        self.retrieve = async_to_streamed_response_wrapper(resource.retrieve)
        self.update = async_to_streamed_response_wrapper(resource.update)


class AsyncLimitsWithStreamingResponse:
    def __init__(self, resource: AsyncLimits) -> None:
        self.retrieve = async_to_streamed_response_wrapper(resource.retrieve)
        self.update = async_to_streamed_response_wrapper(resource.update)
        self.retrieve_key = async_to_streamed_response_wrapper(resource.retrieve_key)
        self.update_key = async_to_streamed_response_wrapper(resource.update_key)


class AsyncApiKeysWithStreamingResponse:
    def __init__(self, resource: AsyncApiKeys) -> None:
        self.list = async_to_streamed_response_wrapper(resource.list)
        self.create = async_to_streamed_response_wrapper(resource.create)
        self.retrieve = async_to_streamed_response_wrapper(resource.retrieve)
        self.revoke = async_to_streamed_response_wrapper(resource.revoke)


class AsyncInvoicesWithStreamingResponse:
    def __init__(self, resource: AsyncInvoices) -> None:
        self.list = async_to_streamed_response_wrapper(resource.list)
        self.retrieve = async_to_streamed_response_wrapper(resource.retrieve)
