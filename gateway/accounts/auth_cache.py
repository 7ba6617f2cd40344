"""Bounded state behind API-key authentication: a least-recently-used cache of answers, and a per-peer
budget of failed authentications.

Both are bounded by count, so no stream of distinct keys or addresses grows the gateway's memory, and
entries are keyed by a digest of the key, so the gateway holds no API key in plain text.
"""

import hashlib
import math
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Generic, TypeVar
from urllib.parse import unquote

V = TypeVar("V")


def key_digest(api_key: str) -> bytes:
    return hashlib.sha256(api_key.encode()).digest()


class LruCache(Generic[V]):
    """At most `capacity` entries of (value, stored at); the least recently used goes first."""

    def __init__(self, capacity: int) -> None:
        if capacity < 1:
            raise ValueError("an LRU cache needs room for at least one entry")
        self._capacity = capacity
        self._entries: OrderedDict[bytes, tuple[V, float]] = OrderedDict()

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, key: bytes) -> bool:
        return key in self._entries

    def get(self, key: bytes) -> tuple[V, float] | None:
        entry = self._entries.get(key)
        if entry is not None:
            self._entries.move_to_end(key)
        return entry

    def put(self, key: bytes, value: V, stored_at: float) -> None:
        self._entries[key] = (value, stored_at)
        self._entries.move_to_end(key)
        while len(self._entries) > self._capacity:
            self._entries.popitem(last=False)

    def discard(self, key: bytes) -> None:
        self._entries.pop(key, None)


@dataclass
class _Budget:
    tokens: float
    updated: float


class FailedAuthLimiter:
    """Failed authentications per peer address as a token bucket: `burst` failures at once, refilled at
    `per_minute`. A peer with no failure left is refused before its key is looked at. At most
    `max_peers` addresses are tracked; the least recently failing is forgotten first."""

    def __init__(self, burst: int, per_minute: float, max_peers: int, clock: Callable[[], float]) -> None:
        self._burst = burst
        self._rate_per_s = per_minute / 60.0
        self._clock = clock
        self._peers: LruCache[_Budget] = LruCache(max_peers)

    def retry_after_s(self, peer: str) -> float:
        """0 when the peer may try again now, else the seconds until it may."""
        budget = self._current(peer)
        if budget is None or budget.tokens >= 1.0:
            return 0.0
        return (1.0 - budget.tokens) / self._rate_per_s

    def record_failure(self, peer: str) -> None:
        budget = self._current(peer) or _Budget(float(self._burst), self._clock())
        budget.tokens = max(0.0, budget.tokens - 1.0)
        self._peers.put(peer.encode(), budget, budget.updated)

    def _current(self, peer: str) -> _Budget | None:
        entry = self._peers.get(peer.encode())
        if entry is None:
            return None
        budget = entry[0]
        now = self._clock()
        budget.tokens = min(float(self._burst), budget.tokens + (now - budget.updated) * self._rate_per_s)
        budget.updated = now
        return budget


def peer_address(peer: str) -> str:
    """The caller's address without its port: gRPC's `ipv4:10.0.0.7:51234` and `ipv6:[::1]:51234`
    (brackets possibly percent-encoded) and aiohttp's `10.0.0.7` all name the host, so that reconnecting
    from a new port does not reset a peer's budget."""
    kind, separator, rest = peer.partition(":")
    if not separator or kind not in ("ipv4", "ipv6"):
        return peer
    rest = unquote(rest)
    if kind == "ipv6" and rest.startswith("["):
        return rest[1 : rest.index("]")] if "]" in rest else rest[1:]
    host, _, port = rest.rpartition(":")
    return host if host and port.isdigit() else rest


def whole_seconds(seconds: float) -> int:
    return max(1, math.ceil(seconds))
