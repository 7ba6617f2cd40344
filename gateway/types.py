"""The gateway's own types, passed between its modules: what a client asks for (`GenerationRequest`), the
plan validated from it (`GenerationPlan`, `SamplingSpec`), what the workers produce (`SampledToken`), what
goes back to the client (`GenerationOutput`, `Usage`) and how a request fails (`ErrorKind`, `GatewayError`).
What is billed is the internal API's `UsageEvent` (diptych_common.internal_api.messages).

No protobuf here. The fronts, `grpc_api/` and `openai_api/` (OpenAI-compatible HTTP), map their
protocol into and out of these types; `core/request_path.py` builds the workers' messages where it calls them.
"""

import enum
import struct
from dataclasses import dataclass, field
from typing import TypeAlias

from transformers import PreTrainedTokenizerBase

from diptych_common.grammar import Grammar
from gateway.fleet.registry import ModelInfo

# A served model's tokenizer: the fast (Rust) one that `AutoTokenizer` loads from the model's directory.
Tokenizer: TypeAlias = PreTrainedTokenizerBase


class ErrorKind(enum.StrEnum):
    """Why a request failed, as a canonical status code. `grpc_api/service.py` sends it as the gRPC status of the same
    name and `openai_api/errors.py` as an HTTP status; the value is the `code` label of the request metrics."""

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
    `rate_limit_metadata` is set by the pipeline once the caller is authenticated (`accounts/ratelimit_headers.py`);
    the client gets it as trailing metadata (gRPC) or headers (HTTP).
    """

    def __init__(self, kind: ErrorKind, message: str, retry_after_ms: int | None = None) -> None:
        super().__init__(message)
        self.kind = kind
        self.message = message
        self.retry_after_ms = retry_after_ms
        self.rate_limit_metadata: tuple[tuple[str, str], ...] = ()


class Priority(enum.IntEnum):
    """The numbers are the public contract's (`diptych.v1.Priority`), which a gRPC client sends as they are."""

    INTERACTIVE = 0  # served first when workers are busy
    BATCH = 1


class FinishReason(enum.StrEnum):
    STOP = "stop"  # the end-of-sequence token or a stop string
    LENGTH = "length"  # max_tokens or the context length
    TOOL_CALLS = "tool_calls"  # the answer is tool calls
    INTERRUPTED = "interrupted"  # the gateway stopped mid-answer: what it handed over, replayed under the key


@dataclass(frozen=True)
class ToolCall:
    id: str
    name: str
    arguments: str  # a JSON object, as text


@dataclass(frozen=True)
class ChatMessage:
    role: str
    content: str
    tool_calls: tuple[ToolCall, ...] = ()  # an assistant message's calls
    tool_call_id: str = ""  # a tool message: the call it answers


@dataclass(frozen=True)
class Tool:
    """A function the model may call."""

    name: str
    description: str = ""
    parameters: str = ""  # its arguments' JSON schema, as text; empty: no arguments
    strict: bool = False


@dataclass(frozen=True)
class ToolChoice:
    mode: str = "auto"  # "auto", "none", "required" or "function"
    function: str = ""  # mode "function": the tool to call


@dataclass(frozen=True)
class ResponseFormat:
    type: str = "text"  # "text", "json_object" or "json_schema"
    schema: str = ""  # json_schema: the schema, as JSON text
    name: str = ""
    strict: bool = False


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
    resume_request_id: str = ""  # replay only: that execution's answer under the idempotency key
    priority: int = Priority.INTERACTIVE  # any number a gRPC client sent; validation refuses unknown ones
    ignore_eos: bool = False
    n: int | None = None  # choices; None: 1
    prompt_cache_key: str = ""
    presence_penalty: float | None = None  # float32 values, as the contract carries them
    frequency_penalty: float | None = None
    logit_bias: dict[int, float] | None = None  # token id -> bias
    logprobs: bool = False
    top_logprobs: int | None = None
    # structured outputs and tools; unset: None
    response_format: ResponseFormat | None = None
    tools: tuple[Tool, ...] = ()
    tool_choice: ToolChoice | None = None
    parallel_tool_calls: bool | None = None


def as_float32(value: float) -> float:
    """`value` at float32 precision, as a float field of the contract holds it (beyond float32's range: inf)."""
    try:
        rounded: float = struct.unpack("f", struct.pack("f", value))[0]
        return rounded
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
    presence_penalty: float = 0.0  # minus this from the logit of every token the output holds
    frequency_penalty: float = 0.0  # minus this times the token's count in the output
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, added to its logit), by token id
    logprobs: bool = False  # each output token comes with its logprob
    top_logprobs: int = 0  # ... and this many of the most likely tokens'
    grammar: Grammar | None = None  # structured outputs: the grammar every output token follows


@dataclass(frozen=True)
class GenerationPlan:
    """A validated, tokenized request: everything the request path needs to run it."""

    request_id: str  # the execution's server-issued id
    organization_id: str
    model: ModelInfo
    tokenizer: Tokenizer
    prompt_token_ids: list[int]
    sampling: SamplingSpec
    stop: list[str]
    priority: Priority = Priority.INTERACTIVE
    client_request_id: str = ""  # the client's own label, kept with its usage
    idempotency_key: str = ""
    n: int = 1  # choices, each its own sequence on the shared prompt
    prompt_cache_key: str = ""
    tools: tuple[Tool, ...] = ()  # the tools whose calls are read out of the output (none: it is text)
    tool_named: bool = False  # tool_choice named the function: its calls finish as "stop", as OpenAI's do

    @property
    def cache_salt(self) -> str:
        """Prefix-cache blocks are shared within an organization only."""
        return self.organization_id


@dataclass(frozen=True)
class WorkerLogprobs:
    """A token's logprob as a worker reports it (after logit_bias and penalties, before temperature), and
    the most likely tokens' (token id, logprob), most likely first."""

    logprob: float
    top: tuple[tuple[int, float], ...] = ()


@dataclass(frozen=True)
class SampledToken:
    """One output token from a worker."""

    token_id: int
    finished: bool = False  # the last token of the request
    finished_by_eos: bool = False  # ... and it is the end-of-sequence token
    logprobs: WorkerLogprobs | None = None  # when the request asked for them


@dataclass(frozen=True)
class TopLogprob:
    token_id: int
    token: str  # its text, as the tokenizer decodes it alone
    logprob: float


@dataclass(frozen=True)
class TokenLogprob:
    """An output token's logprob as the client gets it: with its text and the most likely alternatives."""

    token_id: int
    token: str
    logprob: float
    top_logprobs: tuple[TopLogprob, ...] = ()


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
    """One response of a stream: a text delta and its token ids, of choice `index`. Each choice's last one
    carries its finish reason, the stream's last one the request's usage; a replayed execution
    (idempotency key) is one output per choice holding its whole answer."""

    request_id: str
    text: str
    token_ids: list[int]
    finish_reason: FinishReason | None = None
    usage: Usage | None = None
    index: int = 0  # the choice it belongs to
    tool_calls: tuple[ToolCall, ...] = ()  # on the last output, when the answer is tool calls
    logprobs: list[TokenLogprob] | None = None  # one per token id, when the request asked for them


_INSIDE_FAILURES = {  # what an execution that failed inside the platform is told, by its kind
    ErrorKind.INTERNAL: "the request failed inside the platform",
    ErrorKind.UNAVAILABLE: "no worker could serve the request right now",
    ErrorKind.DEADLINE_EXCEEDED: "the request did not finish in time",
}


def as_told(error: GatewayError, execution_id: str) -> GatewayError:
    """An error that ended an execution inside the platform, in words of its kind and the execution's id: its
    own words (a worker's id, a grammar's parser state) are for the gateway's log, where the request path
    writes them. Any other error is the client's to fix and is told as it is. Both fronts tell it so."""
    said = _INSIDE_FAILURES.get(error.kind)
    if said is None:
        return error
    told = GatewayError(error.kind, f"{said}; retry it, and quote request id {execution_id} if it fails again")
    told.retry_after_ms = error.retry_after_ms
    told.rate_limit_metadata = error.rate_limit_metadata
    return told
