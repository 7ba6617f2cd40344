"""The gateway's own types, passed between its modules: what a client asks for (`GenerationRequest`), the
plan validated from it (`GenerationPlan`, `SamplingSpec`), what the workers produce (`SampledToken`), what
goes back to the client (`GenerationOutput`, `Usage`), what is billed (`UsageEvent`), and how a request
fails (`ErrorKind`, `GatewayError`).

No protobuf here. The fronts, `service.py` (gRPC) and `http_api.py` (OpenAI-compatible HTTP), map their
protocol into and out of these types; `request_path.py` builds the workers' messages where it calls them.
"""

import dataclasses
import enum
import struct
from dataclasses import dataclass, field

from gateway.registry import ModelInfo


class ErrorKind(enum.StrEnum):
    """Why a request failed, as a canonical status code. `service.py` sends it as the gRPC status of the same
    name and `http_api.py` as an HTTP status; the value is the `code` label of the request metrics."""

    INVALID_ARGUMENT = "INVALID_ARGUMENT"
    NOT_FOUND = "NOT_FOUND"
    UNAUTHENTICATED = "UNAUTHENTICATED"
    PERMISSION_DENIED = "PERMISSION_DENIED"
    RESOURCE_EXHAUSTED = "RESOURCE_EXHAUSTED"
    ABORTED = "ABORTED"  # the first request with an idempotency key still runs
    FAILED_PRECONDITION = "FAILED_PRECONDITION"
    UNIMPLEMENTED = "UNIMPLEMENTED"
    UNAVAILABLE = "UNAVAILABLE"
    DEADLINE_EXCEEDED = "DEADLINE_EXCEEDED"
    INTERNAL = "INTERNAL"


class GatewayError(Exception):
    """An error the client sees, with a message that says what to change.

    `retry_after_ms` is set when waiting that long makes the same request succeed (rate limits); the
    client gets it as trailing metadata `retry-after-ms` (gRPC) or a `Retry-After` header (HTTP).
    """

    def __init__(self, kind: ErrorKind, message: str, retry_after_ms: int | None = None) -> None:
        super().__init__(message)
        self.kind = kind
        self.message = message
        self.retry_after_ms = retry_after_ms


class Priority(enum.IntEnum):
    """The numbers are the public contract's (`diptych.v1.Priority`), which a gRPC client sends as they are."""

    INTERACTIVE = 0  # served first when workers are busy
    BATCH = 1


class FinishReason(enum.StrEnum):
    STOP = "stop"  # the end-of-sequence token or a stop string
    LENGTH = "length"  # max_tokens or the context length


@dataclass(frozen=True)
class ChatMessage:
    role: str
    content: str


@dataclass(frozen=True)
class GenerationRequest:
    """A request as the client sent it, before validation. At most one input is set (`prompt`,
    `prompt_token_ids` or `chat`); an input that is set may still be empty. Unset options are None."""

    model: str
    prompt: str | None = None
    prompt_token_ids: list[int] | None = None
    chat: list[ChatMessage] | None = None
    max_tokens: int | None = None
    temperature: float | None = None  # float32 values, as the contract carries them (`as_float32`)
    top_p: float | None = None
    top_k: int = 0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    client_request_id: str = ""
    idempotency_key: str = ""
    priority: int = Priority.INTERACTIVE  # any number a gRPC client sent; validation refuses unknown ones
    ignore_eos: bool = False


def as_float32(value: float) -> float:
    """`value` at float32 precision, as a float field of the contract holds it (beyond float32's range: inf)."""
    try:
        return struct.unpack("f", struct.pack("f", value))[0]
    except OverflowError:
        return float("inf") if value > 0 else float("-inf")


@dataclass(frozen=True)
class SamplingSpec:
    temperature: float = 1.0  # 0: greedy
    top_p: float = 1.0
    top_k: int = 0  # 0: off
    seed: int | None = None
    max_tokens: int = 16  # output tokens in all, the first one included
    ignore_eos: bool = False


@dataclass(frozen=True)
class GenerationPlan:
    """A validated, tokenized request: everything the request path needs to run it."""

    request_id: str  # the execution's server-issued id
    organization_id: str
    model: ModelInfo
    tokenizer: object
    prompt_token_ids: list[int]
    sampling: SamplingSpec
    stop: list[str]
    priority: Priority = Priority.INTERACTIVE
    client_request_id: str = ""  # the client's own label, kept with its usage
    idempotency_key: str = ""

    @property
    def cache_salt(self) -> str:
        """Prefix-cache blocks are shared within an organization only."""
        return self.organization_id


@dataclass(frozen=True)
class SampledToken:
    """One output token from a worker."""

    token_id: int
    finished: bool = False  # the last token of the request
    finished_by_eos: bool = False  # ... and it is the end-of-sequence token


@dataclass(frozen=True)
class PhaseUsage:
    tokens: int
    cached_tokens: int
    kv_bytes: int
    compute_ms: int
    worker_id: str


@dataclass(frozen=True)
class Usage:
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    prefill: PhaseUsage | None = None
    decode: PhaseUsage | None = None


@dataclass(frozen=True)
class GenerationOutput:
    """One response of a stream: a text delta and its token ids. The last one carries the finish reason
    and the usage; a replayed execution (idempotency key) is one output holding the whole answer."""

    request_id: str
    text: str
    token_ids: list[int]
    finish_reason: FinishReason | None = None
    usage: Usage | None = None


@dataclass(frozen=True)
class UsageEvent:
    """What one phase of one execution costs, as the control plane ingests it (its JSON is `as_json()`)."""

    request_id: str  # the execution id; with `phase`, the ledger's idempotency key
    client_request_id: str
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

    def as_json(self) -> dict:
        return dataclasses.asdict(self)
