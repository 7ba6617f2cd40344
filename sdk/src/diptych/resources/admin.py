"""The admin sub-client: usage, billing, spend limit, rate limits, API keys and invoices over the control plane's
REST API.

The client's API key must carry the admin:read scope (admin:write to create or revoke keys and set the
spend limit). The asyncio twins run each call in a worker thread.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from datetime import date, datetime
from typing import TYPE_CHECKING
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
from ..types import (
    NOT_GIVEN,
    ApiKey,
    ApiKeyLimits,
    BillingSummary,
    DailyUsage,
    Invoice,
    NotGiven,
    OrganizationLimits,
    Page,
    SpendLimit,
    UsageGroupBy,
)

if TYPE_CHECKING:
    from .._client import AsyncClient, Client

__all__ = ["Admin", "AsyncAdmin"]

_GROUPS = ("phase", "model", "api_key")


class _Resource:
    def __init__(self, client: Client) -> None:
        self._client = client

    def _request(self, method: str, path: str, *, query: dict | None = None, body: object = None) -> object:
        client = self._client
        return client._admin_transport.request(
            method, path, query=query, body=body, timeout=client.timeout, max_retries=client.max_retries
        )


class Usage(_Resource):
    def daily(self, *, start: date | str, end: date | str, group_by: UsageGroupBy = "phase") -> list[DailyUsage]:
        """Tokens and cost per day from `start` to `end` (inclusive), grouped by phase, model or API key."""
        if group_by not in _GROUPS:
            raise ValueError(f"group_by must be one of {', '.join(_GROUPS)}, not {group_by!r}")
        query = {"start": _day(start), "end": _day(end), "group_by": group_by}
        return daily_usage_from_json(self._request("GET", "/usage/daily", query=query))


class Billing(_Resource):
    def current(self) -> BillingSummary:
        """The current period: amount to date, projection, spend limit and the alerts it triggered."""
        return billing_summary_from_json(self._request("GET", "/billing/current"))


class SpendLimits(_Resource):
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
    def list(self, *, limit: int | None = None, offset: int | None = None) -> Page[ApiKey]:
        body = self._request("GET", "/api-keys", query={"limit": limit, "offset": offset})
        return page_from_json(body, api_key_from_json)

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
    def list(self, *, limit: int | None = None, offset: int | None = None) -> Page[Invoice]:
        body = self._request("GET", "/invoices", query={"limit": limit, "offset": offset})
        return page_from_json(body, invoice_from_json)

    def retrieve(self, invoice_id: str) -> Invoice:
        return invoice_from_json(self._request("GET", f"/invoices/{_segment(invoice_id)}"))


class Admin:
    def __init__(self, client: Client) -> None:
        self.usage = Usage(client)
        self.billing = Billing(client)
        self.spend_limit = SpendLimits(client)
        self.api_keys = ApiKeys(client)
        self.invoices = Invoices(client)
        self.limits = Limits(client)


class _AsyncResource:
    """Runs the sync resource's methods in a worker thread."""

    def __init__(self, sync_resource: _Resource) -> None:
        self._sync = sync_resource

    async def _run(self, method_name: str, *args, **kwargs):
        return await asyncio.to_thread(getattr(self._sync, method_name), *args, **kwargs)


class AsyncUsage(_AsyncResource):
    async def daily(self, *, start: date | str, end: date | str, group_by: UsageGroupBy = "phase") -> list[DailyUsage]:
        return await self._run("daily", start=start, end=end, group_by=group_by)


class AsyncBilling(_AsyncResource):
    async def current(self) -> BillingSummary:
        return await self._run("current")


class AsyncSpendLimits(_AsyncResource):
    async def retrieve(self) -> SpendLimit:
        return await self._run("retrieve")

    async def update(self, *, limit_micros: int | None) -> SpendLimit:
        return await self._run("update", limit_micros=limit_micros)


class AsyncLimits(_AsyncResource):
    async def retrieve(self) -> OrganizationLimits:
        return await self._run("retrieve")

    async def update(
        self,
        *,
        requests_per_minute: int | None | NotGiven = NOT_GIVEN,
        input_tokens_per_minute: int | None | NotGiven = NOT_GIVEN,
        output_tokens_per_minute: int | None | NotGiven = NOT_GIVEN,
    ) -> OrganizationLimits:
        return await self._run(
            "update",
            requests_per_minute=requests_per_minute,
            input_tokens_per_minute=input_tokens_per_minute,
            output_tokens_per_minute=output_tokens_per_minute,
        )

    async def retrieve_key(self, key_id: str) -> ApiKeyLimits:
        return await self._run("retrieve_key", key_id)

    async def update_key(
        self,
        key_id: str,
        *,
        requests_per_minute: int | None | NotGiven = NOT_GIVEN,
        input_tokens_per_minute: int | None | NotGiven = NOT_GIVEN,
        output_tokens_per_minute: int | None | NotGiven = NOT_GIVEN,
    ) -> ApiKeyLimits:
        return await self._run(
            "update_key",
            key_id,
            requests_per_minute=requests_per_minute,
            input_tokens_per_minute=input_tokens_per_minute,
            output_tokens_per_minute=output_tokens_per_minute,
        )


class AsyncApiKeys(_AsyncResource):
    async def list(self, *, limit: int | None = None, offset: int | None = None) -> Page[ApiKey]:
        return await self._run("list", limit=limit, offset=offset)

    async def create(
        self, *, name: str, scopes: Sequence[str] | None = None, expires_at: datetime | None = None
    ) -> ApiKey:
        return await self._run("create", name=name, scopes=scopes, expires_at=expires_at)

    async def retrieve(self, key_id: str) -> ApiKey:
        return await self._run("retrieve", key_id)

    async def revoke(self, key_id: str) -> ApiKey:
        return await self._run("revoke", key_id)


class AsyncInvoices(_AsyncResource):
    async def list(self, *, limit: int | None = None, offset: int | None = None) -> Page[Invoice]:
        return await self._run("list", limit=limit, offset=offset)

    async def retrieve(self, invoice_id: str) -> Invoice:
        return await self._run("retrieve", invoice_id)


class AsyncAdmin:
    def __init__(self, client: AsyncClient) -> None:
        sync = Admin(client)  # type: ignore[arg-type]  # only the options and the HTTP transport are used
        self.usage = AsyncUsage(sync.usage)
        self.billing = AsyncBilling(sync.billing)
        self.spend_limit = AsyncSpendLimits(sync.spend_limit)
        self.api_keys = AsyncApiKeys(sync.api_keys)
        self.invoices = AsyncInvoices(sync.invoices)
        self.limits = AsyncLimits(sync.limits)


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
