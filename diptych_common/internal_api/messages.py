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
        return cls(**_fields_in(cls, body))


@dataclasses.dataclass(frozen=True, kw_only=True)
class RefusalReport:
    """A gateway's count of the requests one limit refused for one API key in one minute (`POST
    rate-limit-refusals`, in batches); sent again under the same `id`, it counts once."""

    id: str
    organization_id: str
    api_key_id: str
    scope: str  # whose limit refused: "organization" or "api_key"
    limit: str  # e.g. "requests_per_minute"
    limit_value: int
    minute: str  # ISO 8601, with the time zone: the minute's start
    refusals: int

    def to_wire(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_wire(cls, body: Mapping[str, Any]) -> Self:
        return cls(**_fields_in(cls, body))


# A model's name in the API (the `model` of a request), short enough for its fleets' names (`<name>-colocated`).
MODEL_NAME_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._-]{0,89}$"
MODEL_NAME_RULE = "use 1 to 90 letters, digits, '.', '_' or '-', starting with a letter or digit"


@dataclasses.dataclass(frozen=True, kw_only=True)
class ModelRegistration:
    """A model directory for the catalog (`POST models/register`, multipart: these fields, then a `files` part
    per path, in the same order). The model gets its prefill, decode and colocated fleets, and its files are
    published as `revision`, which its workers then load."""

    name: str
    context_length: int
    family: str  # the config's model_type
    dtype: str
    revision: str = ""  # empty: named by the files' content
    paths: tuple[str, ...]  # each file's POSIX path in the directory

    def to_wire(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


@dataclasses.dataclass(frozen=True, kw_only=True)
class RegisteredModel:
    """The control plane's answer to a ModelRegistration."""

    name: str
    context_length: int
    revision: str  # the model's current revision, which its workers load
    # role -> a fresh token (the fleet's previous token stops working); empty when the model's fleets already
    # held tokens, which they keep, so workers of the earlier revision hear that they should drain
    fleet_tokens: dict[str, str]

    @classmethod
    def from_wire(cls, body: Mapping[str, Any]) -> Self:
        return cls(**_fields_in(cls, body))


def _fields_in(message: type, body: Mapping[str, Any]) -> dict[str, Any]:
    """The values `body` holds for the message's fields; a message's field it lacks takes its default."""
    return {field.name: body[field.name] for field in dataclasses.fields(message) if field.name in body}
