"""The typed objects the API returns, and the shape of chat messages it accepts."""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import date, datetime
from typing import Any, Final, Generic, Literal, NotRequired, Required, Self, TypedDict, TypeVar

from ._models import BaseModel

__all__ = [
    "NOT_GIVEN",
    "ApiKey",
    "ApiKeyLimits",
    "AsyncCursorPage",
    "AsyncPage",
    "Batch",
    "BatchRequestCounts",
    "BillingSummary",
    "ChatCompletionCreateParams",
    "ChatCompletionMessage",
    "ChatMessageParam",
    "Choice",
    "Completion",
    "CompletionChunk",
    "CompletionCreateParams",
    "CursorPage",
    "DailyUsage",
    "FileObject",
    "FinishReason",
    "FunctionCall",
    "GenerationParams",
    "Invoice",
    "InvoiceLine",
    "InvoiceStatus",
    "MessageParam",
    "Model",
    "NotGiven",
    "OrganizationLimits",
    "Page",
    "PhaseUsage",
    "PostRequestOptions",
    "Priority",
    "PromptTokensDetails",
    "RateLimitStatus",
    "RequestOptions",
    "Response",
    "ResponseCreateParams",
    "ResponseError",
    "ResponseEvent",
    "ResponseFormatParam",
    "ResponseFunctionCall",
    "ResponseFunctionCallOutput",
    "ResponseInputItem",
    "ResponseMessage",
    "ResponseOutputItem",
    "ResponseStatus",
    "ResponseUsage",
    "ServiceTier",
    "SpendAlert",
    "SpendLimit",
    "StreamOptionsParam",
    "TokenLogprob",
    "ToolCall",
    "ToolCallParam",
    "ToolChoiceParam",
    "ToolParam",
    "TopLogprob",
    "Usage",
    "UsageGroupBy",
]


class NotGiven:
    """The default of an argument left out, where None has a meaning of its own (e.g. "unlimited")."""

    def __repr__(self) -> str:
        return "NOT_GIVEN"


NOT_GIVEN: Final = NotGiven()

Priority = Literal["interactive", "batch"]
""""interactive" (the default) goes first when workers are busy; "batch" waits for spare capacity."""

FinishReason = Literal["stop", "length", "tool_calls", "interrupted"]
""""stop": end of sequence or a stop string; "length": max_tokens or the context length reached;
"tool_calls": the answer is tool calls (`Choice.tool_calls`); calls of a function `tool_choice` named
finish as "stop", as OpenAI's do."""


class FunctionCallParam(TypedDict):
    name: str
    arguments: str  # a JSON object, as text


class ToolCallParam(TypedDict):
    """An earlier call of the assistant's, as `Completion.tool_calls` returned it (or OpenAI's shape)."""

    id: str
    type: Literal["function"]
    function: FunctionCallParam


class ChatMessageParam(TypedDict):
    role: Literal["system", "developer", "user", "assistant", "tool"]  # "developer" is read as "system"
    content: str | None
    tool_calls: NotRequired[list[ToolCallParam]]  # an assistant's calls
    tool_call_id: NotRequired[str]  # a tool message: the call it answers


MessageParam = ChatMessageParam | Mapping[str, Any]
"""A chat message as `messages` takes it: a `ChatMessageParam`, or any mapping of the same keys (a plain
`dict[str, str]` built ahead of the call, say), checked when the call is made."""


class StreamOptionsParam(TypedDict, total=False):
    """OpenAI's `stream_options`. The gRPC API sends usage with the stream's last chunk, always, and only there:
    `include_usage` may be True (or left out), `continuous_usage_stats` False (or left out)."""

    include_usage: bool
    continuous_usage_stats: bool


ServiceTier = Literal["auto", "default"]
"""Every request is served at the default tier; `priority="batch"` is what yields to interactive traffic."""


class RequestOptions(TypedDict, total=False):
    """The per-call options of every method: `timeout` (seconds; None: the client's), `extra_headers`,
    `extra_query` (added to the URL's query) and `extra_body` (added to the JSON body, over its fields)."""

    timeout: float | None
    extra_headers: Mapping[str, str] | None
    extra_query: Mapping[str, object] | None
    extra_body: Mapping[str, object] | None


class PostRequestOptions(RequestOptions, total=False):
    """`RequestOptions` of a call that creates or changes something: `idempotency_key` (a fresh one when
    omitted) is sent on every retry, so the server acts once; pass the same one again to make your own retries
    safe too."""

    idempotency_key: str | None


class FunctionParam(TypedDict):
    name: str
    description: NotRequired[str]
    parameters: NotRequired[dict[str, Any]]  # the arguments' JSON schema
    strict: NotRequired[bool]


class ToolParam(TypedDict):
    type: Literal["function"]
    function: FunctionParam


class ToolChoiceFunction(TypedDict):
    name: str


class ToolChoiceParam(TypedDict):
    """A named function the model must call."""

    type: Literal["function"]
    function: ToolChoiceFunction


class JsonSchemaParam(TypedDict):
    name: str
    schema: dict[str, Any]
    strict: NotRequired[bool]


class ResponseFormatParam(TypedDict):
    """{"type": "text"}, {"type": "json_object"} or {"type": "json_schema", "json_schema": {...}}."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: NotRequired[JsonSchemaParam]


class GenerationParams(TypedDict, total=False):
    """The keyword arguments `completions.create` and `chat.completions.create` share."""

    model: Required[str]
    max_tokens: int | None
    temperature: float | None
    top_p: float | None
    top_k: int | None
    seed: int | None
    stop: str | Sequence[str] | None
    priority: Priority
    ignore_eos: bool
    n: int | None
    prompt_cache_key: str | None
    presence_penalty: float | None
    frequency_penalty: float | None
    logit_bias: Mapping[int | str, float] | None
    max_completion_tokens: int | None
    user: str | None
    stream_options: StreamOptionsParam | None
    timeout: float | None
    idempotency_key: str | None
    extra_headers: Mapping[str, str] | None
    extra_query: Mapping[str, object] | None
    extra_body: Mapping[str, object] | None


class CompletionCreateParams(GenerationParams, total=False):
    """The keyword arguments of `completions.create` but `stream`; `help()` of the method shows their defaults."""

    prompt: Required[str | Sequence[int]]
    logprobs: int | None


class ChatCompletionCreateParams(GenerationParams, total=False):
    """The keyword arguments of `chat.completions.create` but `stream`; `help()` of the method shows their
    defaults."""

    messages: Required[Iterable[MessageParam]]
    logprobs: bool | None
    top_logprobs: int | None
    response_format: ResponseFormatParam | None
    tools: Iterable[ToolParam] | None
    tool_choice: Literal["auto", "none", "required"] | ToolChoiceParam | None
    parallel_tool_calls: bool | None
    metadata: Mapping[str, str] | None
    service_tier: ServiceTier | None


@dataclass(frozen=True, slots=True)
class FunctionCall(BaseModel):
    name: str
    arguments: str  # a JSON object, as text; it follows the tool's parameters schema


@dataclass(frozen=True, slots=True)
class ToolCall(BaseModel):
    id: str
    function: FunctionCall
    type: Literal["function"] = "function"


@dataclass(frozen=True, slots=True)
class PhaseUsage(BaseModel):
    """What one phase (prefill or decode) of the request cost, and where it ran."""

    tokens: int
    cached_tokens: int
    kv_bytes: int
    compute_ms: int
    worker_id: str


@dataclass(frozen=True, slots=True)
class PromptTokensDetails(BaseModel):
    cached_tokens: int
    """Of the prompt tokens, those the prefix cache (or the shared KV tier) held."""


@dataclass(frozen=True, slots=True)
class Usage(BaseModel):
    """The request's tokens, as OpenAI counts them (`prompt_tokens_details.cached_tokens`); the flat
    `cached_tokens` is the same count, kept for the SDK's earlier callers. `prefill` and `decode`: what each
    phase cost and where it ran."""

    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    total_tokens: int
    prefill: PhaseUsage | None = None
    decode: PhaseUsage | None = None
    prompt_tokens_details: PromptTokensDetails | None = None

    def __post_init__(self) -> None:
        if self.prompt_tokens_details is None:
            object.__setattr__(self, "prompt_tokens_details", PromptTokensDetails(cached_tokens=self.cached_tokens))


@dataclass(frozen=True, slots=True)
class Completion(BaseModel):
    """A finished generation; `id` is the gateway's request id. `text`, `token_ids` and `finish_reason`
    are the first choice's; `choices` holds every choice (n of them, in order). `usage` covers the whole
    request: the prompt once, every choice's output. `rate_limits`: where the caller stands with its rate
    limits after this request (None when it has none)."""

    id: str
    model: str
    text: str
    token_ids: list[int]
    finish_reason: FinishReason
    usage: Usage
    rate_limits: RateLimitStatus | None = None
    choices: list[Choice] = field(default_factory=list)
    logprobs: list[TokenLogprob] | None = None  # the first choice's, when asked for
    tool_calls: list[ToolCall] | None = None  # the first choice's, when its answer is tool calls


@dataclass(frozen=True, slots=True)
class ChatCompletionMessage(BaseModel):
    """A chat choice's answer in OpenAI's shape: `content` is None when the answer is tool calls only."""

    role: Literal["assistant"]
    content: str | None
    tool_calls: list[ToolCall] | None = None


@dataclass(frozen=True, slots=True)
class Choice(BaseModel):
    """One of a completion's choices: its own sampled sequence of the prompt. `message` is set on chat
    completions only (None for a prompt's completion); `text` is its content either way."""

    index: int
    text: str
    token_ids: list[int]
    finish_reason: FinishReason
    logprobs: list[TokenLogprob] | None = None  # one per token id, when asked for
    tool_calls: list[ToolCall] | None = None  # when the answer is tool calls (finish_reason "tool_calls")
    message: ChatCompletionMessage | None = None


@dataclass(frozen=True, slots=True)
class TopLogprob(BaseModel):
    """One of the most likely tokens where an output token was sampled."""

    token: str
    token_id: int
    logprob: float


@dataclass(frozen=True, slots=True)
class TokenLogprob(BaseModel):
    """An output token's logprob, under the distribution it was sampled from after logit_bias and the
    penalties, before temperature, top_k and top_p; `top_logprobs`: the most likely tokens there, most
    likely first. `token` is its text as the model's tokenizer decodes it alone."""

    token: str
    token_id: int
    logprob: float
    top_logprobs: list[TopLogprob] = field(default_factory=list)


@dataclass(frozen=True, slots=True)
class RateLimitStatus(BaseModel):
    """Where the caller stands with its rate limits, as the gateway told it (`x-ratelimit-*`): for
    requests and for tokens, the most constraining limit per minute, what is left of it after this
    request, and the seconds until it is full again. None where that family has no limit."""

    limit_requests: int | None = None
    remaining_requests: int | None = None
    reset_requests: float | None = None
    limit_tokens: int | None = None
    remaining_tokens: int | None = None
    reset_tokens: float | None = None


@dataclass(frozen=True, slots=True)
class CompletionChunk(BaseModel):
    """One streamed delta of choice `index`; `id` is the request id. `finish_reason` is set on each
    choice's last chunk, `usage` (the whole request's) on the stream's last chunk only."""

    id: str
    text: str
    token_ids: list[int]
    finish_reason: FinishReason | None = None
    usage: Usage | None = None
    index: int = 0
    logprobs: list[TokenLogprob] | None = None  # one per token id, when asked for
    tool_calls: list[ToolCall] | None = None  # on a choice's last chunk, when its answer is tool calls


@dataclass(frozen=True, slots=True)
class Model(BaseModel):
    id: str
    context_length: int
    has_chat_template: bool


# Admin API (REST, served by the control plane). Money is in micro-dollars (1 USD = 1_000_000)
# except invoice totals, which are in cents as invoiced.

T = TypeVar("T")

UsageGroupBy = Literal["phase", "model", "api_key"]
InvoiceStatus = Literal["draft", "open", "paid", "void", "uncollectible"]


class _SyncPages(BaseModel, Generic[T]):
    """Auto-pagination, as openai-python's `SyncPage`: iterating a page yields its items and those of every
    page after it, each fetched when reached; `iter_pages()` yields the pages."""

    __slots__ = ()
    data: list[T]
    has_more: bool
    _next_page: Callable[[], Self] | None

    def has_next_page(self) -> bool:
        # an empty page that claims more would be fetched forever
        return self.has_more and bool(self.data) and self._next_page is not None

    def get_next_page(self) -> Self:
        if self._next_page is None or not self.has_next_page():
            raise RuntimeError("No next page; check has_next_page() first")
        return self._next_page()

    def iter_pages(self) -> Iterator[Self]:
        page = self
        yield page
        while page.has_next_page():
            page = page.get_next_page()
            yield page

    def __iter__(self) -> Iterator[T]:
        for page in self.iter_pages():
            yield from page.data


class _AsyncPages(BaseModel, Generic[T]):
    """The asyncio twin of `_SyncPages` (openai-python's `AsyncPage`): `async for` walks every page."""

    __slots__ = ()
    data: list[T]
    has_more: bool
    _next_page: Callable[[], Awaitable[Self]] | None

    def has_next_page(self) -> bool:
        return self.has_more and bool(self.data) and self._next_page is not None

    async def get_next_page(self) -> Self:
        if self._next_page is None or not self.has_next_page():
            raise RuntimeError("No next page; check has_next_page() first")
        return await self._next_page()

    async def iter_pages(self) -> AsyncIterator[Self]:
        page = self
        yield page
        while page.has_next_page():
            page = await page.get_next_page()
            yield page

    async def __aiter__(self) -> AsyncIterator[T]:
        async for page in self.iter_pages():
            for item in page.data:
                yield item


@dataclass(frozen=True, slots=True)
class Page(_SyncPages[T]):
    """One page of an offset list: `data`, whether more follows (`has_more`) and the `total` count."""

    data: list[T]
    has_more: bool
    total: int
    _next_page: Callable[[], Self] | None = field(default=None, repr=False, compare=False)


@dataclass(frozen=True, slots=True)
class AsyncPage(_AsyncPages[T]):
    """`Page` of the asyncio client."""

    data: list[T]
    has_more: bool
    total: int
    _next_page: Callable[[], Awaitable[Self]] | None = field(default=None, repr=False, compare=False)


@dataclass(frozen=True, slots=True)
class ApiKey(BaseModel):
    """An API key. `key`, the secret itself, is set only on the object `api_keys.create()` returns."""

    id: str
    name: str
    prefix: str
    scopes: list[str]
    created_at: datetime
    last_used_at: datetime | None
    expires_at: datetime | None
    revoked_at: datetime | None
    key: str | None = None
    project_id: str = ""  # the project the key was issued in (its limits, spend and usage)


@dataclass(frozen=True, slots=True)
class DailyUsage(BaseModel):
    """Tokens and their price for one day and one group: a phase ("prefill", "cached_prefill",
    "decode"), a model name or an API key id, as asked by `group_by`."""

    day: date
    key: str
    tokens: int
    amount_micros: int


@dataclass(frozen=True, slots=True)
class SpendAlert(BaseModel):
    threshold_percent: int
    triggered_at: datetime


@dataclass(frozen=True, slots=True)
class BillingSummary(BaseModel):
    """The current billing period: spend to date, its projection to the period's end, the limit."""

    period_start: date
    period_end: date
    currency: str
    amount_to_date_micros: int
    projected_micros: int
    spend_limit_micros: int | None
    alerts: list[SpendAlert]


@dataclass(frozen=True, slots=True)
class SpendLimit(BaseModel):
    limit_micros: int | None


@dataclass(frozen=True, slots=True)
class OrganizationLimits(BaseModel):
    """The organization's per-minute rate limits (None: unlimited) and its spend limit per billing period
    (micro-dollars; set it with `admin.spend_limit.update`)."""

    organization_id: str
    requests_per_minute: int | None
    input_tokens_per_minute: int | None
    output_tokens_per_minute: int | None
    spend_limit_micros: int | None


@dataclass(frozen=True, slots=True)
class ApiKeyLimits(BaseModel):
    """One API key's per-minute rate limits (None: unlimited); the organization's apply on top."""

    api_key_id: str
    requests_per_minute: int | None
    input_tokens_per_minute: int | None
    output_tokens_per_minute: int | None


@dataclass(frozen=True, slots=True)
class InvoiceLine(BaseModel):
    model: str
    phase: str
    tokens: int
    unit_price_micros_per_million: int
    amount_micros: int
    tier: str = "standard"  # "batch": Batch API requests, at the batch price


@dataclass(frozen=True, slots=True)
class Invoice(BaseModel):
    id: str
    period_start: date
    period_end: date
    status: InvoiceStatus
    currency: str
    total_cents: int
    lines: list[InvoiceLine]
    stripe_invoice_id: str | None


# ---- the Batch API ---------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class CursorPage(_SyncPages[T]):
    """One page of a list, newest first: pass `last_id` as `after` for the next page while `has_more` (or
    iterate the page, which does it)."""

    data: list[T]
    has_more: bool
    last_id: str | None
    _next_page: Callable[[], Self] | None = field(default=None, repr=False, compare=False)


@dataclass(frozen=True, slots=True)
class AsyncCursorPage(_AsyncPages[T]):
    """`CursorPage` of the asyncio client."""

    data: list[T]
    has_more: bool
    last_id: str | None
    _next_page: Callable[[], Awaitable[Self]] | None = field(default=None, repr=False, compare=False)


@dataclass(frozen=True, slots=True)
class FileObject(BaseModel):
    """A JSON Lines file: a batch's input (purpose "batch") or its output or errors ("batch_output")."""

    id: str
    bytes: int
    created_at: int  # seconds since the epoch
    filename: str
    purpose: str


@dataclass(frozen=True, slots=True)
class BatchRequestCounts(BaseModel):
    total: int
    completed: int
    failed: int


@dataclass(frozen=True, slots=True)
class Batch(BaseModel):
    """A batch of requests run in the background at batch priority and price. `status` is one of validating,
    in_progress, finalizing, completed, failed, expired, cancelling, cancelled; times are seconds since the
    epoch, None until reached."""

    id: str
    endpoint: str
    input_file_id: str
    completion_window: str
    status: str
    output_file_id: str | None
    error_file_id: str | None
    request_counts: BatchRequestCounts
    created_at: int
    expires_at: int
    in_progress_at: int | None = None
    finalizing_at: int | None = None
    completed_at: int | None = None
    failed_at: int | None = None
    expired_at: int | None = None
    cancelling_at: int | None = None
    cancelled_at: int | None = None
    metadata: dict[str, str] | None = None


# The Responses API (the gateway's HTTP API, `http_url`): OpenAI's Response objects, stored by default.

ResponseStatus = Literal["queued", "in_progress", "completed", "incomplete", "failed", "cancelled"]
"""queued and in_progress: a background response still running; incomplete: max_output_tokens (or the
context) cut it; cancelled: a background response cancelled, holding what it produced until then."""


class ResponseFunctionToolParam(TypedDict):
    """A function the model may call, in the Responses API's flat shape."""

    type: Literal["function"]
    name: str
    description: NotRequired[str]
    parameters: NotRequired[dict[str, Any]]
    strict: NotRequired[bool]


class ResponseCreateParams(TypedDict, total=False):
    """The keyword arguments of `responses.create` and `responses.stream`; `help()` of either shows their
    defaults. `input` is a string (one user message) or OpenAI's items: messages, `function_call` and
    `function_call_output` items."""

    model: Required[str]
    input: Required[str | Iterable[Mapping[str, object]]]
    instructions: str | None
    max_output_tokens: int | None
    temperature: float | None
    top_p: float | None
    seed: int | None
    text: Mapping[str, object] | None
    tools: Iterable[ResponseFunctionToolParam] | None
    tool_choice: Literal["auto", "none", "required"] | Mapping[str, str] | None
    parallel_tool_calls: bool | None
    metadata: Mapping[str, str] | None
    store: bool | None
    truncation: Literal["disabled", "auto"] | None
    previous_response_id: str | None
    user: str | None
    prompt_cache_key: str | None
    timeout: float | None
    idempotency_key: str | None
    extra_headers: Mapping[str, str] | None
    extra_query: Mapping[str, object] | None
    extra_body: Mapping[str, object] | None


@dataclass(frozen=True, slots=True)
class ResponseUsage(BaseModel):
    """`cached_tokens`: of the input tokens, those the prefix cache held (billed at the cached price)."""

    input_tokens: int
    cached_tokens: int
    output_tokens: int
    total_tokens: int


@dataclass(frozen=True, slots=True)
class ResponseError(BaseModel):
    code: str
    message: str


@dataclass(frozen=True, slots=True)
class ResponseMessage(BaseModel):
    """A message: the assistant's in a response's output (its text the joined output_text parts), or one of
    the input's (role user, system, developer or assistant)."""

    id: str
    role: str
    text: str
    status: str | None = None
    type: Literal["message"] = "message"


@dataclass(frozen=True, slots=True)
class ResponseFunctionCall(BaseModel):
    """A call the model made: answer it with a `function_call_output` item of the same `call_id`."""

    id: str
    call_id: str
    name: str
    arguments: str  # a JSON object, as text
    status: str | None = None
    type: Literal["function_call"] = "function_call"


@dataclass(frozen=True, slots=True)
class ResponseFunctionCallOutput(BaseModel):
    id: str
    call_id: str
    output: str
    status: str | None = None
    type: Literal["function_call_output"] = "function_call_output"


ResponseOutputItem = ResponseMessage | ResponseFunctionCall
ResponseInputItem = ResponseMessage | ResponseFunctionCall | ResponseFunctionCallOutput


@dataclass(frozen=True, slots=True)
class Response(BaseModel):
    """A response of the Responses API; `output_text` joins the text of its messages. Times are seconds since
    the epoch."""

    id: str
    status: ResponseStatus
    model: str
    created_at: int
    output: list[ResponseOutputItem]
    usage: ResponseUsage | None = None
    previous_response_id: str | None = None
    background: bool = False
    store: bool = True
    error: ResponseError | None = None
    incomplete_reason: str | None = None
    metadata: dict[str, str] = field(default_factory=dict)
    completed_at: int | None = None

    @property
    def output_text(self) -> str:
        return "".join(item.text for item in self.output if isinstance(item, ResponseMessage))


@dataclass(frozen=True, slots=True)
class ResponseEvent(BaseModel):
    """One event of a streamed response, as OpenAI names them ("response.output_text.delta", ...): `delta` on
    text and arguments deltas, `item` on output_item events, `response` on response.created, .in_progress,
    .completed, .incomplete and .failed."""

    type: str
    sequence_number: int
    delta: str | None = None
    item_id: str | None = None
    output_index: int | None = None
    item: ResponseOutputItem | None = None
    response: Response | None = None
