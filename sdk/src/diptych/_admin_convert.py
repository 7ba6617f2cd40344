"""Parsing the admin API's JSON into the SDK's typed objects, refusing what breaks the contract."""

from __future__ import annotations

from collections.abc import Callable
from datetime import date, datetime
from typing import TypeVar, cast, get_args

from ._errors import APIResponseValidationError
from .types import (
    ApiKey,
    ApiKeyLimits,
    BillingSummary,
    DailyUsage,
    Invoice,
    InvoiceLine,
    InvoiceStatus,
    OrganizationLimits,
    Page,
    SpendAlert,
    SpendLimit,
)

T = TypeVar("T")


def page_from_json(body: object, parse_item: Callable[[object], T]) -> Page[T]:
    items = _field(body, "data", list)
    return Page(
        data=[parse_item(item) for item in items],
        has_more=_field(body, "has_more", bool),
        total=_field(body, "total", int),
    )


def api_key_from_json(body: object) -> ApiKey:
    return ApiKey(
        id=_field(body, "id", str),
        name=_field(body, "name", str),
        prefix=_field(body, "prefix", str),
        scopes=[str(scope) for scope in _field(body, "scopes", list)],
        created_at=_datetime(body, "created_at"),
        last_used_at=_optional(body, "last_used_at", _datetime),
        expires_at=_optional(body, "expires_at", _datetime),
        revoked_at=_optional(body, "revoked_at", _datetime),
        key=_optional(body, "key", lambda obj, name: _field(obj, name, str)),
        project_id=_optional(body, "project_id", lambda obj, name: _field(obj, name, str)) or "",
    )


def daily_usage_from_json(body: object) -> list[DailyUsage]:
    return [
        DailyUsage(
            day=_date(row, "day"),
            key=_field(row, "key", str),
            tokens=_field(row, "tokens", int),
            amount_micros=_field(row, "amount_micros", int),
        )
        for row in _field(body, "data", list)
    ]


def billing_summary_from_json(body: object) -> BillingSummary:
    return BillingSummary(
        period_start=_date(body, "period_start"),
        period_end=_date(body, "period_end"),
        currency=_field(body, "currency", str),
        amount_to_date_micros=_field(body, "amount_to_date_micros", int),
        projected_micros=_field(body, "projected_micros", int),
        spend_limit_micros=_optional(body, "spend_limit_micros", lambda obj, name: _field(obj, name, int)),
        alerts=[
            SpendAlert(
                threshold_percent=_field(alert, "threshold_percent", int), triggered_at=_datetime(alert, "triggered_at")
            )
            for alert in _field(body, "alerts", list)
        ],
    )


def spend_limit_from_json(body: object) -> SpendLimit:
    return SpendLimit(limit_micros=_optional(body, "limit_micros", lambda obj, name: _field(obj, name, int)))


def organization_limits_from_json(body: object) -> OrganizationLimits:
    return OrganizationLimits(
        organization_id=_field(body, "organization_id", str),
        **_rate_limits(body),
        spend_limit_micros=_optional_int(body, "spend_limit_micros"),
    )


def api_key_limits_from_json(body: object) -> ApiKeyLimits:
    return ApiKeyLimits(api_key_id=_field(body, "api_key_id", str), **_rate_limits(body))


def _rate_limits(body: object) -> dict[str, int | None]:
    names = ("requests_per_minute", "input_tokens_per_minute", "output_tokens_per_minute")
    return {name: _optional_int(body, name) for name in names}


def _optional_int(body: object, name: str) -> int | None:
    if not isinstance(body, dict) or name not in body:
        raise APIResponseValidationError(f"The admin API's answer lacks the field {name!r}")
    return _optional(body, name, lambda obj, field_name: _field(obj, field_name, int))


def invoice_from_json(body: object) -> Invoice:
    return Invoice(
        id=_field(body, "id", str),
        period_start=_date(body, "period_start"),
        period_end=_date(body, "period_end"),
        status=_invoice_status(_field(body, "status", str)),
        currency=_field(body, "currency", str),
        total_cents=_field(body, "total_cents", int),
        lines=[
            InvoiceLine(
                model=_field(line, "model", str),
                phase=_field(line, "phase", str),
                tokens=_field(line, "tokens", int),
                unit_price_micros_per_million=_field(line, "unit_price_micros_per_million", int),
                amount_micros=_field(line, "amount_micros", int),
                tier=_optional(line, "tier", lambda obj, name: _field(obj, name, str)) or "standard",
            )
            for line in _field(body, "lines", list)
        ],
        stripe_invoice_id=_optional(body, "stripe_invoice_id", lambda obj, name: _field(obj, name, str)) or None,
    )


def _invoice_status(value: str) -> InvoiceStatus:
    if value in get_args(InvoiceStatus):
        return cast(InvoiceStatus, value)
    raise APIResponseValidationError(f"The admin API's invoice status {value!r} is none of {get_args(InvoiceStatus)}")


def _field(body: object, name: str, kind: type[T]) -> T:
    if not isinstance(body, dict) or name not in body:
        raise APIResponseValidationError(f"The admin API's answer lacks the field {name!r}")
    value = body[name]
    # bool is an int in Python, and an int field holding true/false breaks the contract.
    if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
        raise APIResponseValidationError(f"The admin API's field {name!r} should be {kind.__name__}, not {value!r}")
    return value


def _optional(body: object, name: str, parse: Callable[[object, str], T]) -> T | None:
    if isinstance(body, dict) and body.get(name) is None:
        return None
    return parse(body, name)


def _datetime(body: object, name: str) -> datetime:
    text = _field(body, name, str)
    try:
        return datetime.fromisoformat(text)
    except ValueError:
        raise APIResponseValidationError(f"The admin API's field {name!r} is not an ISO 8601 time: {text!r}") from None


def _date(body: object, name: str) -> date:
    """A day ("2026-11-21") or a moment ("2026-11-01T00:00:00Z"), both are dates."""
    text = _field(body, name, str)
    try:
        return date.fromisoformat(text) if len(text) == 10 else datetime.fromisoformat(text)
    except ValueError:
        raise APIResponseValidationError(f"The admin API's field {name!r} is not an ISO 8601 date: {text!r}") from None
