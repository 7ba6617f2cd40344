"""API key authentication against the control plane, cached for a few seconds so that a revoked key
stops working within that time without a control-plane call per request. While the control plane is
unreachable, a key verified in the last STALE_GRACE_S seconds keeps working from the cache, so that
serving (and spooling usage) goes on through a control-plane outage.

Flooding the gateway with bogus keys neither evicts good keys nor reaches the control plane at will:
verified keys live in their own least-recently-used cache; refused keys (unknown, revoked, expired) are
remembered for REFUSED_TTL_S in a separate one of their own bound; and each peer address has a budget
of failed authentications, past which it gets RESOURCE_EXHAUSTED (HTTP 429) with the time to wait,
before its key is sent to the control plane. A key verified within the TTL passes even then.

The control plane's answer carries the key's scopes, the rate limits of the key, its project and its
organization, and the spend of the organization and of the project. Each
of these is read defensively: a field the control plane does not send means unlimited or allowed.
"""

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from diptych_common.internal_api.client import ControlPlaneClient, ControlPlaneUnavailable
from gateway.accounts.auth_cache import FailedAuthLimiter, LruCache, key_digest, peer_address, whole_seconds
from gateway.types import ErrorKind, GatewayError, GenerationRequest, Priority

INFERENCE_SCOPE = "inference"
STALE_GRACE_S = 300.0
MAX_CACHED_KEYS = 10_000  # verified keys
MAX_REFUSED_KEYS = 10_000  # refused keys, bounded apart so they never evict verified ones
REFUSED_TTL_S = 2.0
FAILED_AUTH_BURST = 20  # failed authentications a peer may make at once ...
FAILED_AUTH_PER_MINUTE = 30  # ... and then at this rate
MAX_TRACKED_PEERS = 10_000


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
    scopes: tuple[str, ...] | None = None  # None: the control plane sends no scopes (all allowed)
    organization_limits: RateLimits = field(default_factory=RateLimits)
    key_limits: RateLimits = field(default_factory=RateLimits)
    spend: Spend = field(default_factory=Spend)
    project_id: str = ""  # "": the control plane names no project (then no project limits apply)
    project_limits: RateLimits = field(default_factory=RateLimits)
    project_spend: Spend = field(default_factory=Spend)
    kind: str = "standard"  # "batch": a batch's runner key, whose usage is billed at the batch tier
    batch_id: str = ""  # the batch whose lines a runner key sends


class Authenticator:
    def __init__(
        self, control_plane: ControlPlaneClient, ttl_s: float = 5.0, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self._control_plane = control_plane
        self._ttl_s = ttl_s
        self._clock = clock
        self._verified: LruCache[Caller] = LruCache(MAX_CACHED_KEYS)  # key digest -> (Caller, verified at)
        self._refused: LruCache[None] = LruCache(MAX_REFUSED_KEYS)  # key digest -> (None, refused at)
        self._failures = FailedAuthLimiter(FAILED_AUTH_BURST, FAILED_AUTH_PER_MINUTE, MAX_TRACKED_PEERS, clock)

    async def authenticate_header(self, authorization: str | None, peer: str = "") -> Caller:
        """The caller named by an `Authorization: Bearer <key>` value, allowed to run inference. `peer` is
        the caller's address (gRPC `context.peer()` or the HTTP request's remote): failed attempts are
        counted against it."""
        caller = await self.identify(authorization, peer)
        check_allowed(caller)
        return caller

    async def identify(self, authorization: str | None, peer: str = "") -> Caller:
        """The caller named by the key, not yet checked for what it may do (`check_allowed`)."""
        address = peer_address(peer)
        try:
            caller = await self._caller_for(authorization, address)
        except GatewayError as error:
            if error.kind is ErrorKind.UNAUTHENTICATED:
                self._failures.record_failure(address)
            raise
        return caller

    async def _caller_for(self, authorization: str | None, address: str) -> Caller:
        api_key = _bearer_token(authorization)
        digest = key_digest(api_key)
        verified = self._verified.get(digest)
        if verified is not None and self._age(verified) < self._ttl_s:
            return verified[0]
        self._refuse_if_over_failure_budget(address)
        refused = self._refused.get(digest)
        if refused is not None and self._age(refused) < REFUSED_TTL_S:
            raise _invalid_key()
        return await self._verify(api_key, digest, verified)

    async def _verify(self, api_key: str, digest: bytes, verified: tuple[Caller, float] | None) -> Caller:
        try:
            identity = await self._control_plane.verify_api_key(api_key)
        except ControlPlaneUnavailable:
            if verified is None or self._age(verified) >= STALE_GRACE_S:
                raise GatewayError(
                    ErrorKind.UNAVAILABLE, "cannot verify the API key right now; retry shortly"
                ) from None
            return verified[0]
        if identity is None:
            self._verified.discard(digest)
            self._refused.put(digest, None, self._clock())
            raise _invalid_key()
        caller = caller_from_identity(identity)
        self._refused.discard(digest)
        self._verified.put(digest, caller, self._clock())
        return caller

    def _refuse_if_over_failure_budget(self, address: str) -> None:
        wait_s = self._failures.retry_after_s(address)
        if wait_s > 0:
            raise GatewayError(
                ErrorKind.RESOURCE_EXHAUSTED,
                f"too many failed authentications from {address or 'this address'}; retry in "
                f"{whole_seconds(wait_s)} s with a valid API key",
                retry_after_ms=max(1, round(wait_s * 1000)),
            )

    def _age(self, entry: tuple[object, float]) -> float:
        return self._clock() - entry[1]


def _invalid_key() -> GatewayError:
    return GatewayError(ErrorKind.UNAUTHENTICATED, "the API key is not valid: it is unknown, revoked or expired")


def caller_from_identity(identity: dict[str, Any]) -> Caller:
    limits = identity.get("limits") or {}
    scopes = identity.get("scopes")
    return Caller(
        organization_id=identity["organization_id"],
        api_key_id=identity["api_key_id"],
        scopes=tuple(scopes) if isinstance(scopes, list) else None,
        kind="batch" if identity.get("kind") == "batch" else "standard",
        batch_id=str(identity.get("batch_id") or ""),
        organization_limits=_rate_limits(limits.get("organization")),
        key_limits=_rate_limits(limits.get("api_key")),
        spend=_spend(identity.get("spend")),
        project_id=str(identity.get("project_id") or ""),
        project_limits=_rate_limits(limits.get("project")),
        project_spend=_spend(identity.get("project_spend")),
    )


def _spend(entry: object) -> Spend:
    if not isinstance(entry, dict):
        return Spend()
    return Spend(
        limit_micros=_optional_int(entry.get("limit_micros")),
        spent_micros=_optional_int(entry.get("spent_micros")) or 0,
        over_limit=bool(entry.get("over_limit", False)),
    )


def check_allowed(caller: Caller, request: GenerationRequest | None = None) -> None:
    """Refuses a caller whose key lacks the inference scope or whose organization or project is over its spend
    limit, and a batch's runner key for anything but `request` being a line of its batch."""
    if caller.kind == "batch" and not _is_line_of_batch(request, caller.batch_id):
        raise GatewayError(
            ErrorKind.PERMISSION_DENIED,
            "this API key is a batch's runner key: it only sends the lines of its batch, at batch priority",
        )
    if caller.scopes is not None and INFERENCE_SCOPE not in caller.scopes:
        raise GatewayError(
            ErrorKind.PERMISSION_DENIED,
            f"this API key lacks the '{INFERENCE_SCOPE}' scope; create a key with that scope to generate text",
        )
    if caller.spend.over_limit:
        limit = caller.spend.limit_micros
        amount = f"${limit / 1_000_000:,.2f}" if limit is not None else "your organization's limit"
        raise GatewayError(
            ErrorKind.RESOURCE_EXHAUSTED,
            f"spend limit of {amount} reached for this billing period; raise it (PUT /api/v1/spend-limit) "
            "or wait for the next billing period",
        )
    if caller.project_spend.over_limit:
        limit = caller.project_spend.limit_micros
        amount = f"${limit / 1_000_000:,.2f}" if limit is not None else "its limit"
        raise GatewayError(
            ErrorKind.RESOURCE_EXHAUSTED,
            f"spend limit of {amount} reached by project {caller.project_id} for this billing period; raise it "
            f"(PATCH /api/v1/projects/{caller.project_id}) or wait for the next billing period",
        )


def _is_line_of_batch(request: GenerationRequest | None, batch_id: str) -> bool:
    """The control plane's runner sends each line at batch priority under the Idempotency-Key
    `batch-<batch id>-<digest of its custom_id>` (controlplane/batches/runner.py)."""
    return (
        request is not None
        and bool(batch_id)
        and request.priority == Priority.BATCH
        and request.idempotency_key.startswith(f"batch-{batch_id}-")
    )


def _rate_limits(entry: object) -> RateLimits:
    if not isinstance(entry, dict):
        return RateLimits()
    return RateLimits(
        requests_per_minute=_optional_int(entry.get("requests_per_minute")),
        input_tokens_per_minute=_optional_int(entry.get("input_tokens_per_minute")),
        output_tokens_per_minute=_optional_int(entry.get("output_tokens_per_minute")),
    )


def _optional_int(value: Any) -> int | None:
    return None if value is None else int(value)


def _bearer_token(authorization: str | None) -> str:
    if authorization:
        scheme, _, token = authorization.partition(" ")
        if scheme.lower() == "bearer" and token.strip():
            return token.strip()
    raise GatewayError(
        ErrorKind.UNAUTHENTICATED,
        "missing API key: send 'authorization: Bearer <api key>' (a gRPC metadata entry or an HTTP header)",
    )
