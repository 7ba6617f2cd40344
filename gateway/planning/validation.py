"""Checks a request and turns it into a plan the request path can run. Every refusal says what to change."""

import dataclasses
import math
import re
import uuid
from typing import Any

from gateway.fleet.registry import ModelInfo, Registry
from gateway.planning.json_body import TooDeep
from gateway.planning.structured import MAX_TOOLS, plan_structure
from gateway.planning.tokenization import TooManyTokens, encode_chat, encode_prompt, model_tokenizer, run_off_loop
from gateway.planning.tools import MAX_ARGUMENTS_DEPTH, template_calls, template_tools
from gateway.types import (
    ChatMessage,
    ErrorKind,
    GatewayError,
    GenerationPlan,
    GenerationRequest,
    Priority,
    SamplingSpec,
    Tokenizer,
    Tool,
    as_float32,
)

DEFAULT_MAX_TOKENS = 16  # a completion's default; a chat's is the rest of the context
MAX_CHOICES = 16
MAX_PROMPT_CACHE_KEY_LENGTH = 255
MAX_STOP_STRINGS = 4
MAX_STOP_LENGTH = 64
# A message's role as a client sends it -> as the chat template takes it: OpenAI's `developer` messages
# are the system's.
CHAT_ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant", "tool": "tool"}
# Prompts are refused by size before tokenizing: a model takes at most PROMPT_BYTES_PER_TOKEN bytes of
# text per token of its context (real text averages about 4 bytes a token), and never more than
# MAX_PROMPT_BYTES, however long its context.
PROMPT_BYTES_PER_TOKEN = 16
MAX_PROMPT_BYTES = 4 << 20
# Sampling below these is not numerically safe (logits / temperature overflow); 0 means greedy instead.
MIN_TEMPERATURE = 0.01
MIN_TOP_P = 0.001
FLOAT32_MAX = 3.4028234663852886e38
MAX_IDEMPOTENCY_KEY_LENGTH = 255
# Sampling controls, OpenAI's bounds.
MAX_PENALTY = 2.0
MAX_LOGIT_BIAS = 100.0
MAX_LOGIT_BIAS_ENTRIES = 300
MAX_TOP_LOGPROBS = 20
_REQUEST_ID = re.compile(r"[A-Za-z0-9_.:-]{1,128}")


async def plan_generation(request: GenerationRequest, registry: Registry, organization_id: str) -> GenerationPlan:
    check_counts(len(request.stop), len(request.logit_bias or {}), len(request.tools))
    client_request_id = _client_request_id(request.client_request_id)
    idempotency_key = _idempotency_key(request.idempotency_key)
    priority = _priority(request.priority)
    choices = _choices(request.n)
    prompt_cache_key = _prompt_cache_key(request.prompt_cache_key)
    model = registry.models.get(request.model)
    if model is None:
        available = ", ".join(sorted(registry.models)) or "none"
        raise _invalid(
            f"model {_shown(request.model)} does not exist; available models: {available}", ErrorKind.NOT_FOUND
        )
    tokenizer = await model_tokenizer(model.source)
    structure = await plan_structure(request, model.source, organization_id)
    prompt = await _prompt_token_ids(request, tokenizer, model, organization_id)
    return GenerationPlan(
        request_id=new_execution_id(),
        organization_id=organization_id,
        client_request_id=client_request_id,
        idempotency_key=idempotency_key,
        n=choices,
        prompt_cache_key=prompt_cache_key,
        model=model,
        tokenizer=tokenizer,
        prompt_token_ids=prompt,
        sampling=dataclasses.replace(
            _with_controls(_sampling(request, model, len(prompt)), request, len(tokenizer)), grammar=structure.grammar
        ),
        tools=structure.tools,
        tool_named=structure.tool_named,
        stop=_stop_strings(request.stop),
        priority=priority,
    )


def new_execution_id() -> str:
    """Every execution gets its own id from the gateway: the usage ledger's key, never the client's."""
    return f"exec_{uuid.uuid4().hex}"


def check_counts(stop: int, logit_bias: int, tools: int) -> None:
    """Refuses more stop strings, logit_bias entries or tools than a request may hold (OpenAI's bounds). The
    fronts call it before converting them too: converting costs per entry."""
    for name, count, limit, unit in (
        ("stop", stop, MAX_STOP_STRINGS, "strings"),
        ("logit_bias", logit_bias, MAX_LOGIT_BIAS_ENTRIES, "tokens"),
        ("tools", tools, MAX_TOOLS, "tools"),
    ):
        if count > limit:
            raise _invalid(f"{name} holds {count} {unit}; send at most {limit}")


def is_client_label(text: str) -> bool:
    """Whether `text` may label a request in usage (GenerateRequest.request_id, the HTTP API's user)."""
    return bool(_REQUEST_ID.fullmatch(text))


def _client_request_id(client_id: str) -> str:
    if client_id and not _REQUEST_ID.fullmatch(client_id):
        raise _invalid("request_id must be 1 to 128 characters of letters, digits, '_', '.', ':' or '-'")
    return client_id


def _idempotency_key(key: str) -> str:
    if key and (len(key) > MAX_IDEMPOTENCY_KEY_LENGTH or not key.isprintable()):
        raise _invalid(f"idempotency_key must be 1 to {MAX_IDEMPOTENCY_KEY_LENGTH} printable characters")
    return key


def _choices(n: int | None) -> int:
    if n is None:
        return 1
    if not 1 <= n <= MAX_CHOICES:
        raise _invalid(f"n must be from 1 to {MAX_CHOICES} (choices to generate), got {n}")
    return n


def _prompt_cache_key(key: str) -> str:
    if key and (len(key) > MAX_PROMPT_CACHE_KEY_LENGTH or not key.isprintable()):
        raise _invalid(f"prompt_cache_key must be 1 to {MAX_PROMPT_CACHE_KEY_LENGTH} printable characters")
    return key


def _priority(number: int) -> Priority:
    try:
        return Priority(number)
    except ValueError:
        raise _invalid(f"priority {number} is unknown; use PRIORITY_INTERACTIVE or PRIORITY_BATCH") from None


class PromptTooLong(GatewayError):
    """A prompt the model's context cannot hold with one output token (by its tokens, or by its bytes, over
    what the context could hold): the HTTP fronts tell it as OpenAI's `context_length_exceeded`, which
    clients that trim conversations key on."""

    def __init__(self, message: str) -> None:
        super().__init__(ErrorKind.INVALID_ARGUMENT, message)


def max_prompt_bytes(model: ModelInfo) -> int:
    return min(MAX_PROMPT_BYTES, PROMPT_BYTES_PER_TOKEN * model.context_length)


async def _prompt_token_ids(
    request: GenerationRequest, tokenizer: Tokenizer, model: ModelInfo, tenant: str
) -> list[int]:
    """The prompt's token ids, fewer than the context holds; tokenizing and chat templates run off the event
    loop, on the tenant's share of its threads, after the size checks."""
    if request.prompt_token_ids is not None:
        return _checked_token_ids(request.prompt_token_ids, tokenizer, model)
    try:
        if request.prompt is not None:
            if not request.prompt:
                raise _invalid("prompt must not be empty")
            _check_prompt_size(request.prompt, model)
            return await run_off_loop(encode_prompt, tokenizer, request.prompt, model.context_length, tenant=tenant)
        if request.chat is not None:
            return await run_off_loop(_encode_chat, request.chat, request.tools, tokenizer, model, tenant=tenant)
    except TooManyTokens as too_many:
        raise _too_many_tokens(too_many.count, model) from None
    raise _invalid("set one of prompt, prompt_token_ids or chat")


def _encode_chat(chat: list[ChatMessage], tools: tuple[Tool, ...], tokenizer: Tokenizer, model: ModelInfo) -> list[int]:
    """The chat checked, rendered with its tools and tokenized, all on a tokenizer thread: the tool calls'
    arguments and the tools' schemas it parses may be megabytes of JSON."""
    messages = _chat_messages(chat, tokenizer, model)
    return encode_chat(tokenizer, messages, template_tools(tools), model.context_length)


def _checked_token_ids(ids: list[int], tokenizer: Tokenizer, model: ModelInfo) -> list[int]:
    if not ids:
        raise _invalid("prompt_token_ids must not be empty")
    if len(ids) >= model.context_length:
        raise _too_many_tokens(len(ids), model)
    vocab_size = len(tokenizer)
    out_of_range = [i for i in ids if i >= vocab_size]
    if out_of_range:
        raise _invalid(f"prompt_token_ids holds {out_of_range[0]}, outside the vocabulary of size {vocab_size}")
    return list(ids)


def _chat_messages(messages: list[ChatMessage], tokenizer: Tokenizer, model: ModelInfo) -> list[dict[str, Any]]:
    if not messages:
        raise _invalid("chat.messages must hold at least one message")
    if not tokenizer.chat_template:
        raise _invalid("this model has no chat template; send a completion prompt instead")
    limit, total = max_prompt_bytes(model), 0
    for index, message in enumerate(messages):
        if message.role not in CHAT_ROLES:
            raise _invalid(f"chat.messages[{index}].role is {_shown(message.role)}; use one of {', '.join(CHAT_ROLES)}")
        size = _utf8_length(message.content) + sum(_utf8_length(c.arguments) for c in message.tool_calls)
        if size > limit:
            raise PromptTooLong(f"chat.messages[{index}].content is {size} bytes; {_size_rule(model)}; shorten it")
        total += size
    if total > limit:
        raise PromptTooLong(
            f"chat.messages hold {total} bytes of content in all; {_size_rule(model)}; send fewer or shorter messages"
        )
    return [_template_message(index, message) for index, message in enumerate(messages)]


def _template_message(index: int, message: ChatMessage) -> dict[str, Any]:
    """A message as the chat template takes it: an assistant's tool calls, a tool's answer with its call id."""
    rendered: dict[str, Any] = {"role": CHAT_ROLES[message.role], "content": message.content}
    if message.tool_calls:
        if message.role != "assistant":
            raise _invalid(f"chat.messages[{index}] has tool_calls, which only an assistant message may have")
        try:
            rendered["tool_calls"] = template_calls(message.tool_calls)
        except TooDeep:
            raise _invalid(
                f"chat.messages[{index}].tool_calls holds arguments nesting deeper than {MAX_ARGUMENTS_DEPTH} "
                "levels; send flatter arguments"
            ) from None
        except ValueError:
            raise _invalid(
                f"chat.messages[{index}].tool_calls holds arguments that are not JSON; send each call's "
                "arguments as a JSON object in a string"
            ) from None
    if message.role == "tool":
        if not message.tool_call_id:
            raise _invalid(f"chat.messages[{index}] is a tool message without tool_call_id; name the call it answers")
        rendered["tool_call_id"] = message.tool_call_id
    return rendered


def _check_prompt_size(prompt: str, model: ModelInfo) -> None:
    size = _utf8_length(prompt)
    if size > max_prompt_bytes(model):
        raise PromptTooLong(f"prompt is {size} bytes; {_size_rule(model)}; shorten the prompt")


def _size_rule(model: ModelInfo) -> str:
    return (
        f"{model.name} takes at most {max_prompt_bytes(model)} bytes of prompt text "
        f"({PROMPT_BYTES_PER_TOKEN} bytes per token of its {model.context_length}-token context, "
        f"{MAX_PROMPT_BYTES} at most)"
    )


def _shown(text: str) -> str:
    """A client's string, quoted and short enough for an error message."""
    return f"'{text}'" if len(text) <= 64 else f"'{text[:61]}...'"


def _utf8_length(text: str) -> int:
    return len(text) if text.isascii() else len(text.encode("utf-8", "surrogatepass"))


def _too_many_tokens(tokens: int, model: ModelInfo) -> GatewayError:
    return PromptTooLong(
        f"the prompt has {tokens} tokens but {model.name} has a context length of "
        f"{model.context_length}, which must also hold at least one output token; shorten the prompt"
    )


def _sampling(request: GenerationRequest, model: ModelInfo, prompt_length: int) -> SamplingSpec:
    room = model.context_length - prompt_length
    if request.max_tokens is not None:
        if request.max_tokens < 1:
            raise _invalid(f"max_tokens must be at least 1, got {request.max_tokens}")
        if request.max_tokens > room:
            raise _invalid(
                f"max_tokens is {request.max_tokens} but {model.name}'s context length of {model.context_length} "
                f"leaves room for at most {room} tokens after the {prompt_length}-token prompt; lower max_tokens"
            )
        max_tokens = request.max_tokens
    else:
        max_tokens = room if request.chat is not None else min(DEFAULT_MAX_TOKENS, room)
    temperature = request.temperature if request.temperature is not None else 1.0
    _check_temperature(temperature)
    top_p = request.top_p if request.top_p is not None else 1.0
    _check_top_p(top_p)
    return SamplingSpec(
        temperature=temperature,
        top_p=top_p,
        top_k=request.top_k,
        seed=request.seed,
        max_tokens=max_tokens,
        ignore_eos=request.ignore_eos,
    )


def _with_controls(sampling: SamplingSpec, request: GenerationRequest, vocab_size: int) -> SamplingSpec:
    """The sampling with the request's penalties, logit_bias and logprobs, checked."""
    penalties = {}
    for name in ("presence_penalty", "frequency_penalty"):
        value = getattr(request, name)
        if value is not None:
            if not (math.isfinite(value) and -MAX_PENALTY <= value <= MAX_PENALTY):
                raise _invalid(f"{name} must be from -{MAX_PENALTY:g} to {MAX_PENALTY:g}, got {_float32_text(value)}")
            penalties[name] = value
    top_logprobs = request.top_logprobs
    if top_logprobs is not None:
        if not request.logprobs:
            raise _invalid("top_logprobs needs logprobs set to true; set logprobs or remove top_logprobs")
        if not 0 <= top_logprobs <= MAX_TOP_LOGPROBS:
            raise _invalid(f"top_logprobs must be from 0 to {MAX_TOP_LOGPROBS}, got {top_logprobs}")
    return dataclasses.replace(
        sampling,
        **penalties,
        logit_bias=_logit_bias(request.logit_bias or {}, vocab_size),
        logprobs=request.logprobs,
        top_logprobs=top_logprobs or 0,
    )


def _logit_bias(bias: dict[int, float], vocab_size: int) -> tuple[tuple[int, float], ...]:
    for token_id, value in sorted(bias.items()):
        if not 0 <= token_id < vocab_size:
            raise _invalid(
                f"logit_bias names token {token_id}, outside the vocabulary of size {vocab_size}; "
                "send token ids of this model's tokenizer"
            )
        if not (math.isfinite(value) and -MAX_LOGIT_BIAS <= value <= MAX_LOGIT_BIAS):
            raise _invalid(
                f"logit_bias for token {token_id} must be from -{MAX_LOGIT_BIAS:g} to {MAX_LOGIT_BIAS:g}, "
                f"got {_float32_text(value)}"
            )
    return tuple(sorted(bias.items()))


def _check_temperature(temperature: float) -> None:
    if not (math.isfinite(temperature) and 0.0 <= temperature <= 2.0):
        raise _invalid(f"temperature must be between 0 and 2 (0 is greedy), got {_float32_text(temperature)}")
    if 0.0 < temperature < as_float32(MIN_TEMPERATURE):
        raise _invalid(
            f"temperature {_float32_text(temperature)} is too small to sample with safely; "
            f"send 0 for greedy decoding or at least {MIN_TEMPERATURE}"
        )


def _check_top_p(top_p: float) -> None:
    if not (math.isfinite(top_p) and 0.0 < top_p <= 1.0):
        raise _invalid(f"top_p must be greater than 0 and at most 1, got {_float32_text(top_p)}")
    if top_p < as_float32(MIN_TOP_P):
        raise _invalid(
            f"top_p {_float32_text(top_p)} is too small to sample with safely; "
            f"send at least {MIN_TOP_P}, or temperature 0 for greedy decoding"
        )


def _float32_text(value: float) -> str:
    """The shortest text of a float field's value: 1e-40, not the 9.99995e-41 that float32 stores."""
    if not math.isfinite(value):
        return f"{value:g}"
    for digits in range(1, 10):
        text = f"{value:.{digits}g}"
        if abs(float(text)) <= FLOAT32_MAX and as_float32(float(text)) == value:
            return text
    return repr(value)


def _stop_strings(stop: list[str]) -> list[str]:
    for s in stop:
        if not s or len(s) > MAX_STOP_LENGTH:
            raise _invalid(f"each stop string must be 1 to {MAX_STOP_LENGTH} characters long")
    return list(stop)


def _invalid(message: str, kind: ErrorKind = ErrorKind.INVALID_ARGUMENT) -> GatewayError:
    return GatewayError(kind, message)
