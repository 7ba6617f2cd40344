"""The messages of the internal API, each defined once: a frozen dataclass whose `to_wire()` is the JSON
body sent and whose `from_wire()` reads one.

The control plane's serializers (platform/controlplane/internal/) translate the same bodies over HTTP; a
test (tests/platform/test_platform_internal_contracts.py) checks that their fields agree with these.
"""

import dataclasses
from collections.abc import Mapping
from typing import Any, Self


@dataclasses.dataclass(frozen=True, kw_only=True)
class UsageEvent:
    """What one phase of one execution costs, as the gateway reports it and the control plane's ledger
    stores it (`POST usage-events`, in batches)."""

    request_id: str  # the execution id; with `phase`, the ledger's idempotency key
    client_request_id: str = ""  # the client's own label of the request, when it gave one
    phase: str  # "prefill" or "decode"
    organization_id: str
    api_key_id: str
    model: str
    region: str
    worker_id: str
    tokens: int
    cached_tokens: int
    kv_bytes: int
    compute_ms: int
    started_at: str  # ISO 8601, with the time zone
    finished_at: str
    # The price tier: "batch" for a request of the Batch API (a batch runner's key), else "standard". The
    # default lets events spooled before the field existed still be replayed.
    tier: str = "standard"

    @property
    def idempotency_key(self) -> tuple[str, str]:
        return self.request_id, self.phase

    def to_wire(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_wire(cls, body: Mapping[str, Any]) -> Self:
        """The event in `body`; a field it lacks takes its default (an event spooled before it existed)."""
        return cls(**{field.name: body[field.name] for field in dataclasses.fields(cls) if field.name in body})
