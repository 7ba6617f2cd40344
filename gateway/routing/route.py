"""The routing's plain data: what a request asks of the router (`RouteRequest`), what it gets (`Route`),
and the serving modes and decisions they name."""

import enum
from dataclasses import dataclass

from gateway.fleet.registry import WorkerInfo


class ServingMode(enum.StrEnum):
    AUTO = "auto"  # split when both fleets have ready workers, colocated otherwise
    SPLIT = "split"
    COLOCATED = "colocated"


class Decision(enum.StrEnum):
    SPLIT = "split"
    SPLIT_SKIPPED = "split_skipped"  # both phases on the decode worker
    COLOCATED = "colocated"


class Phase(enum.StrEnum):
    """What a worker is picked for: the prompt of a split pair, its decode, or both on one worker."""

    PREFILL = "prefill"
    DECODE = "decode"
    COLOCATED = "colocated"


@dataclass(frozen=True)
class Route:
    prefill: WorkerInfo  # the worker that runs the prompt (both phases unless `decode` is set)
    decode: WorkerInfo | None
    decision: Decision
    matched_tokens: int = 0  # prompt tokens the prefill worker holds, by its published block hashes
    prompt_tokens: int = 0

    @property
    def uncached_tokens(self) -> int:
        """The prompt tokens the prefill worker will compute."""
        return max(0, self.prompt_tokens - self.matched_tokens)

    @property
    def colocated(self) -> bool:
        return self.decode is None


@dataclass(frozen=True)
class Pin:
    """The workers a request should reuse while they are usable: those of its n>1 request's first choice."""

    prefill: str  # worker ids
    decode: str


@dataclass(frozen=True)
class RouteRequest:
    model: str
    prompt_token_ids: list[int]
    max_tokens: int
    avoid: frozenset[str] = frozenset()  # worker ids that already failed this request
    cache_salt: str = ""  # the organization's prefix-cache salt (PrefillRequest.cache_salt)
    pin: Pin | None = None
    session_key: str = ""  # the prompt_cache_key, scoped to the organization (empty: none)
