"""API key authentication against the control plane, cached for a few seconds so that a revoked key
stops working within that time without a control-plane call per request. While the control plane is
unreachable, a key verified in the last STALE_GRACE_S seconds keeps working from the cache, so that
serving (and spooling usage) goes on through a control-plane outage.

The control plane's answer carries the key's scopes, its rate limits and the organization's spend. Each
of these is read defensively: a field the control plane does not send means unlimited or allowed.
"""

import time
from dataclasses import dataclass, field

import grpc

from gateway.control_plane import ControlPlaneClient, ControlPlaneUnavailable
from gateway.errors import GatewayError

INFERENCE_SCOPE = "inference"
STALE_GRACE_S = 300.0
MAX_CACHED_KEYS = 10_000


@dataclass(frozen=True)
class RateLimits:
    """Per-minute limits; None means unlimited."""
    requests_per_minute: int | None = None
    input_tokens_per_minute: int | None = None
    output_tokens_per_minute: int | None = None


@dataclass(frozen=True)
class Spend:
    limit_micros: int | None = None
    spent_micros: int = 0
    over_limit: bool = False


@dataclass(frozen=True)
class Caller:
    organization_id: str
    api_key_id: str
    scopes: tuple[str, ...] | None = None        # None: the control plane sends no scopes (all allowed)
    organization_limits: RateLimits = field(default_factory=RateLimits)
    key_limits: RateLimits = field(default_factory=RateLimits)
    spend: Spend = field(default_factory=Spend)


class Authenticator:
    def __init__(self, control_plane: ControlPlaneClient, ttl_s: float = 5.0) -> None:
        self._control_plane = control_plane
        self._ttl_s = ttl_s
        self._cache: dict[str, tuple[Caller | None, float]] = {}   # key -> (caller, verified at, monotonic)

    async def authenticate_header(self, authorization: str | None) -> Caller:
        """The caller named by an `Authorization: Bearer <key>` value, allowed to run inference."""
        api_key = _bearer_token(authorization)
        cached = self._cache.get(api_key)
        age = time.monotonic() - cached[1] if cached is not None else None
        if age is not None and age < self._ttl_s:
            caller = cached[0]
        else:
            try:
                caller = await self._verify(api_key)
            except ControlPlaneUnavailable:
                if age is None or age >= STALE_GRACE_S:
                    raise GatewayError(
                        grpc.StatusCode.UNAVAILABLE, "cannot verify the API key right now; retry shortly"
                    ) from None
                caller = cached[0]
            else:
                self._remember(api_key, caller)
        if caller is None:
            raise GatewayError(grpc.StatusCode.UNAUTHENTICATED, "the API key is not valid: it is unknown, revoked or expired")
        _check_allowed(caller)
        return caller

    def _remember(self, api_key: str, caller: Caller | None) -> None:
        now = time.monotonic()
        if len(self._cache) >= MAX_CACHED_KEYS:   # many distinct keys (unknown ones too): drop the old
            self._cache = {k: v for k, v in self._cache.items() if now - v[1] < STALE_GRACE_S}
            if len(self._cache) >= MAX_CACHED_KEYS:
                self._cache.clear()
        self._cache[api_key] = (caller, now)

    async def _verify(self, api_key: str) -> Caller | None:
        identity = await self._control_plane.verify_api_key(api_key)
        if identity is None:
            return None
        return caller_from_identity(identity)


def caller_from_identity(identity: dict) -> Caller:
    limits = identity.get("limits") or {}
    spend = identity.get("spend") or {}
    scopes = identity.get("scopes")
    return Caller(
        organization_id=identity["organization_id"],
        api_key_id=identity["api_key_id"],
        scopes=tuple(scopes) if isinstance(scopes, list) else None,
        organization_limits=_rate_limits(limits.get("organization")),
        key_limits=_rate_limits(limits.get("api_key")),
        spend=Spend(
            limit_micros=_optional_int(spend.get("limit_micros")),
            spent_micros=_optional_int(spend.get("spent_micros")) or 0,
            over_limit=bool(spend.get("over_limit", False)),
        ),
    )


def _check_allowed(caller: Caller) -> None:
    if caller.scopes is not None and INFERENCE_SCOPE not in caller.scopes:
        raise GatewayError(
            grpc.StatusCode.PERMISSION_DENIED,
            f"this API key lacks the '{INFERENCE_SCOPE}' scope; create a key with that scope to generate text",
        )
    if caller.spend.over_limit:
        limit = caller.spend.limit_micros
        amount = f"${limit / 1_000_000:,.2f}" if limit is not None else "your organization's limit"
        raise GatewayError(
            grpc.StatusCode.RESOURCE_EXHAUSTED,
            f"spend limit of {amount} reached for this billing period; raise it (PUT /api/v1/spend-limit) "
            "or wait for the next billing period",
        )


def _rate_limits(entry) -> RateLimits:
    if not isinstance(entry, dict):
        return RateLimits()
    return RateLimits(
        requests_per_minute=_optional_int(entry.get("requests_per_minute")),
        input_tokens_per_minute=_optional_int(entry.get("input_tokens_per_minute")),
        output_tokens_per_minute=_optional_int(entry.get("output_tokens_per_minute")),
    )


def _optional_int(value) -> int | None:
    return None if value is None else int(value)


def _bearer_token(authorization: str | None) -> str:
    if authorization:
        scheme, _, token = authorization.partition(" ")
        if scheme.lower() == "bearer" and token.strip():
            return token.strip()
    raise GatewayError(
        grpc.StatusCode.UNAUTHENTICATED, "missing API key: send 'authorization: Bearer <api key>' (a gRPC metadata entry or an HTTP header)"
    )
