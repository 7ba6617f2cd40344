"""Rate limits per organization, per project and per API key: requests, input tokens and output tokens per
minute.

Each limit is a token bucket holding up to one minute's allowance and refilling continuously. A request
takes from every bucket that applies to it at once, or from none: it is admitted only when all of them
hold enough. With `REDIS_URL` the buckets live in Redis and one Lua script checks and takes them
atomically, so that several gateways share the limits; otherwise they live in this process.

Output tokens are reserved up front (the request's max_tokens; a bounded estimate where the client set no
max_tokens, see `pipeline.reserved_output_tokens`) and settled against the real count when the request
ends: the unused part is refunded, an excess over an estimate is taken then.

Both backends answer every take with each bucket's state (`BucketState`: whole units left and the time
until it is full again), after the take when the request was admitted and as it stood when it was
refused, so that clients can be told where they stand (`ratelimit_headers.py`).
"""

import logging
import math
import time
from dataclasses import dataclass, field

from gateway.accounts.auth import Caller
from gateway.accounts.refusals import RefusalTally
from gateway.metrics import RATE_LIMITED
from gateway.types import ErrorKind, GatewayError

log = logging.getLogger(__name__)

WINDOW_MS = 60_000
KEY_TTL_MS = 2 * WINDOW_MS

_KINDS = (
    ("requests_per_minute", "requests"),
    ("input_tokens_per_minute", "input tokens"),
    ("output_tokens_per_minute", "output tokens"),
)

# KEYS: the buckets. ARGV: for each bucket its capacity then its cost. Returns {0, 0, states...} when taken,
# else {milliseconds until every bucket holds enough, index (1-based) of the bucket that needs the longest,
# states...}; the states are, for each bucket, the whole units it holds then the milliseconds until it is
# full (after the take when taken). (%-formatting: the script's own braces rule out str.format.)
_TAKE = """
local now_parts = redis.call('TIME')
local now = tonumber(now_parts[1]) * 1000 + math.floor(tonumber(now_parts[2]) / 1000)
local levels = {}
local wait = 0
local blocking = 0
for i = 1, #KEYS do
  local capacity = tonumber(ARGV[2 * i - 1])
  local cost = tonumber(ARGV[2 * i])
  local state = redis.call('HMGET', KEYS[i], 'tokens', 'ts')
  local tokens = tonumber(state[1]) or capacity
  local ts = tonumber(state[2]) or now
  local rate = capacity / %(window_ms)d.0
  tokens = math.min(capacity, tokens + math.max(0, now - ts) * rate)
  levels[i] = tokens
  if tokens < cost then
    local needed = math.ceil((cost - tokens) / rate)
    if needed > wait then
      wait = needed
      blocking = i
    end
  end
end
if wait == 0 then
  for i = 1, #KEYS do
    levels[i] = levels[i] - tonumber(ARGV[2 * i])
    redis.call('HSET', KEYS[i], 'tokens', tostring(levels[i]), 'ts', now)
    redis.call('PEXPIRE', KEYS[i], %(key_ttl_ms)d)
  end
end
local answer = {wait, blocking}
for i = 1, #KEYS do
  local capacity = tonumber(ARGV[2 * i - 1])
  answer[2 * i + 1] = math.floor(levels[i])
  if capacity > 0 then
    answer[2 * i + 2] = math.ceil((capacity - levels[i]) * %(window_ms)d / capacity)
  else
    answer[2 * i + 2] = 0
  end
end
return answer
""" % {"window_ms": WINDOW_MS, "key_ttl_ms": KEY_TTL_MS}  # noqa: UP031

# KEYS: the buckets. ARGV: for each bucket its capacity then the amount to give back.
_REFUND = """
for i = 1, #KEYS do
  local tokens = tonumber(redis.call('HGET', KEYS[i], 'tokens'))
  if tokens then
    local capacity = tonumber(ARGV[2 * i - 1])
    redis.call('HSET', KEYS[i], 'tokens', tostring(math.min(capacity, tokens + tonumber(ARGV[2 * i]))))
  end
end
return 0
"""


@dataclass(frozen=True)
class Bucket:
    key: str  # e.g. "org:<id>:input tokens"
    scope: str  # "organization", "project" or "API key"
    kind: str  # "requests", "input tokens" or "output tokens"
    capacity: int  # the per-minute limit
    cost: int


@dataclass(frozen=True)
class BucketState:
    """Where one bucket stands: whole units left and milliseconds until it is full again."""

    scope: str
    kind: str
    capacity: int
    remaining: int
    reset_ms: int


@dataclass
class Reservation:
    """What a request took; `settle` gives back the output tokens it did not use. `states`: every
    bucket that applies, right after the take."""

    output_buckets: list[Bucket]
    reserved_output_tokens: int
    states: list[BucketState] = field(default_factory=list)


class RateLimited(GatewayError):
    """RESOURCE_EXHAUSTED by a rate limit; `states`: every bucket that applies, as it stood (nothing taken)."""

    def __init__(self, message: str, states: list[BucketState], retry_after_ms: int | None = None) -> None:
        super().__init__(ErrorKind.RESOURCE_EXHAUSTED, message, retry_after_ms)
        self.states = states


class RateLimiter:
    def __init__(self, redis_url: str | None = None, refusals: RefusalTally | None = None) -> None:
        self._local: dict[str, tuple[float, float]] = {}  # key -> (tokens, updated at in ms)
        self.refusals = refusals or RefusalTally()  # what it refused, for the control plane
        self._redis = None
        if redis_url:
            import redis.asyncio as redis_asyncio

            self._redis = redis_asyncio.from_url(redis_url)
            self._take_script = self._redis.register_script(_TAKE)
            self._refund_script = self._redis.register_script(_REFUND)

    @property
    def backend(self) -> str:
        return "redis" if self._redis is not None else "in-process"

    async def admit(self, caller: Caller, input_tokens: int, max_output_tokens: int) -> Reservation:
        """Takes one request, its input tokens and its max_tokens from every bucket that applies, or
        raises RateLimited (RESOURCE_EXHAUSTED) with the time after which the same request would be admitted."""
        buckets = _buckets(caller, input_tokens, max_output_tokens)
        for bucket in buckets:
            if bucket.cost > bucket.capacity:
                self._count_refusal(caller, bucket)
                raise RateLimited(
                    f"this request needs {bucket.cost} {bucket.kind} but the {bucket.scope} limit is "
                    f"{bucket.capacity} {bucket.kind} per minute; "
                    + ("lower max_tokens" if bucket.kind == "output tokens" else "shorten the prompt"),
                    await self.current(caller),
                )
        wait_ms, blocking_index, states = await self._take(buckets) if buckets else (0, 0, [])
        if wait_ms > 0:
            blocking = buckets[blocking_index]
            self._count_refusal(caller, blocking)
            raise RateLimited(
                f"rate limit reached: the {blocking.scope} limit of {blocking.capacity} {blocking.kind} per minute; "
                f"retry after {wait_ms} ms",
                states,
                retry_after_ms=wait_ms,
            )
        output = [b for b in buckets if b.kind == "output tokens"]
        return Reservation(output_buckets=output, reserved_output_tokens=max_output_tokens, states=states)

    def _count_refusal(self, caller: Caller, bucket: Bucket) -> None:
        """In the metric, and in the tally the control plane receives (by key and limit)."""
        RATE_LIMITED.labels(bucket.scope, bucket.kind).inc()
        self.refusals.record(caller.organization_id, caller.api_key_id, bucket.scope, bucket.kind, bucket.capacity)

    async def current(self, caller: Caller) -> list[BucketState]:
        """Every bucket that applies to `caller`, as it stands now; nothing is taken."""
        buckets = _buckets(caller, 0, 0, requests=0)
        return (await self._take(buckets))[2] if buckets else []

    async def settle(self, reservation: Reservation, output_tokens: int) -> None:
        # Negative when the request produced more than it reserved (an estimate, where max_tokens was not
        # set): the excess is taken now, and the bucket may go below zero until it refills.
        unused = reservation.reserved_output_tokens - output_tokens
        if not unused or not reservation.output_buckets:
            return
        refunds = [Bucket(b.key, b.scope, b.kind, b.capacity, unused) for b in reservation.output_buckets]
        if self._redis is not None:
            try:
                await self._refund_script(keys=[b.key for b in refunds], args=_script_args(refunds))
                return
            except Exception as error:
                log.warning("Redis refund failed, refunding in process: %r", error)
        for bucket in refunds:
            tokens, updated = self._local.get(bucket.key, (float(bucket.capacity), _now_ms()))
            self._local[bucket.key] = (min(float(bucket.capacity), tokens + bucket.cost), updated)

    async def close(self) -> None:
        if self._redis is not None:
            await self._redis.aclose()

    async def _take(self, buckets: list[Bucket]) -> tuple[int, int, list[BucketState]]:
        """(0, 0, states after the take) when taken, else (milliseconds to wait, index of the bucket that
        needs the longest, states as they stand)."""
        if self._redis is not None:
            try:
                answer = await self._take_script(keys=[b.key for b in buckets], args=_script_args(buckets))
                states = [
                    BucketState(b.scope, b.kind, b.capacity, int(answer[2 * i + 2]), int(answer[2 * i + 3]))
                    for i, b in enumerate(buckets)
                ]
                return int(answer[0]), max(0, int(answer[1]) - 1), states
            except Exception as error:  # Redis down: keep limiting, in this process only
                log.warning("Redis rate limiting failed, limiting in process: %r", error)
        return self._take_local(buckets)

    def _take_local(self, buckets: list[Bucket]) -> tuple[int, int, list[BucketState]]:
        now = _now_ms()
        levels = [self._level(bucket, now) for bucket in buckets]
        waits = [
            math.ceil((b.cost - level) * WINDOW_MS / b.capacity) if level < b.cost else 0
            for b, level in zip(buckets, levels, strict=True)
        ]
        longest = max(range(len(waits)), key=waits.__getitem__)
        if waits[longest]:
            return waits[longest], longest, _states(buckets, levels)
        levels = [level - bucket.cost for bucket, level in zip(buckets, levels, strict=True)]
        for bucket, level in zip(buckets, levels, strict=True):
            self._local[bucket.key] = (level, now)
        return 0, 0, _states(buckets, levels)

    def _level(self, bucket: Bucket, now: float) -> float:
        tokens, updated = self._local.get(bucket.key, (float(bucket.capacity), now))
        return min(float(bucket.capacity), tokens + (now - updated) * bucket.capacity / WINDOW_MS)


def _states(buckets: list[Bucket], levels: list[float]) -> list[BucketState]:
    """As the Lua script computes them, so that both backends report alike."""
    return [
        BucketState(b.scope, b.kind, b.capacity, math.floor(level), _reset_ms(b.capacity, level))
        for b, level in zip(buckets, levels, strict=True)
    ]


def _reset_ms(capacity: int, level: float) -> int:
    """Milliseconds until the bucket is full; a limit of 0 is always full (and always refuses)."""
    return math.ceil((capacity - level) * WINDOW_MS / capacity) if capacity > 0 else 0


def _buckets(caller: Caller, input_tokens: int, max_output_tokens: int, requests: int = 1) -> list[Bucket]:
    costs = {"requests": requests, "input tokens": input_tokens, "output tokens": max_output_tokens}
    buckets = []
    for scope, prefix, owner, limits in (
        ("organization", "org", caller.organization_id, caller.organization_limits),
        ("project", "proj", caller.project_id, caller.project_limits),
        ("API key", "key", caller.api_key_id, caller.key_limits),
    ):
        if not owner:  # a caller verified without a project
            continue
        for field_name, kind in _KINDS:
            limit = getattr(limits, field_name)
            if limit is not None:
                buckets.append(Bucket(f"diptych:rl:{prefix}:{owner}:{kind}", scope, kind, limit, costs[kind]))
    return buckets


def _script_args(buckets: list[Bucket]) -> list[int]:
    return [value for b in buckets for value in (b.capacity, b.cost)]


def _now_ms() -> float:
    return time.monotonic() * 1000
