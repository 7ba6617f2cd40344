from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from functools import cached_property
from typing import TYPE_CHECKING, Literal, overload

from .._convert import chat_input, generate_request, new_idempotency_key, structured_input
from .._response import async_to_raw_response_wrapper, to_raw_response_wrapper
from .._streaming import AsyncStream, Stream
from ..types import ChatMessageParam, Completion, Priority, ResponseFormatParam, ToolChoiceParam, ToolParam
from ._generate import generate, generate_async

if TYPE_CHECKING:
    from .._client import AsyncClient, Client

__all__ = ["Chat", "AsyncChat", "ChatCompletions", "AsyncChatCompletions"]


class ChatCompletions:
    def __init__(self, client: Client) -> None:
        self._client = client

    @cached_property
    def with_raw_response(self) -> ChatCompletionsWithRawResponse:
        """`create` answering an `APIResponse`: the gateway's metadata (`headers`, `request_id`, `rate_limits`)
        and `parse()`, the usual result."""
        return ChatCompletionsWithRawResponse(self)

    @overload
    def create(
        self,
        *,
        model: str,
        messages: Iterable[ChatMessageParam],
        max_tokens: int | None = None,
        temperature: float | None = None,
        top_p: float | None = None,
        top_k: int | None = None,
        seed: int | None = None,
        stop: str | Sequence[str] | None = None,
        priority: Priority = "interactive",
        ignore_eos: bool = False,
        n: int | None = None,
        prompt_cache_key: str | None = None,
        presence_penalty: float | None = None,
        frequency_penalty: float | None = None,
        logit_bias: Mapping[int | str, float] | None = None,
        logprobs: bool | None = None,
        top_logprobs: int | None = None,
        response_format: ResponseFormatParam | None = None,
        tools: Iterable[ToolParam] | None = None,
        tool_choice: Literal["auto", "none", "required"] | ToolChoiceParam | None = None,
        parallel_tool_calls: bool | None = None,
        stream: Literal[False] = False,
        timeout: float | None = None,
        idempotency_key: str | None = None,
        extra_headers: Mapping[str, str] | None = None,
        extra_body: Mapping[str, object] | None = None,
    ) -> Completion: ...

    @overload
    def create(
        self,
        *,
        model: str,
        messages: Iterable[ChatMessageParam],
        max_tokens: int | None = None,
        temperature: float | None = None,
        top_p: float | None = None,
        top_k: int | None = None,
        seed: int | None = None,
        stop: str | Sequence[str] | None = None,
        priority: Priority = "interactive",
        ignore_eos: bool = False,
        n: int | None = None,
        prompt_cache_key: str | None = None,
        presence_penalty: float | None = None,
        frequency_penalty: float | None = None,
        logit_bias: Mapping[int | str, float] | None = None,
        logprobs: bool | None = None,
        top_logprobs: int | None = None,
        response_format: ResponseFormatParam | None = None,
        tools: Iterable[ToolParam] | None = None,
        tool_choice: Literal["auto", "none", "required"] | ToolChoiceParam | None = None,
        parallel_tool_calls: bool | None = None,
        stream: Literal[True],
        timeout: float | None = None,
        idempotency_key: str | None = None,
        extra_headers: Mapping[str, str] | None = None,
        extra_body: Mapping[str, object] | None = None,
    ) -> Stream: ...

    def create(
        self,
        *,
        model: str,
        messages: Iterable[ChatMessageParam],
        max_tokens: int | None = None,
        temperature: float | None = None,
        top_p: float | None = None,
        top_k: int | None = None,
        seed: int | None = None,
        stop: str | Sequence[str] | None = None,
        priority: Priority = "interactive",
        ignore_eos: bool = False,
        n: int | None = None,
        prompt_cache_key: str | None = None,
        presence_penalty: float | None = None,
        frequency_penalty: float | None = None,
        logit_bias: Mapping[int | str, float] | None = None,
        logprobs: bool | None = None,
        top_logprobs: int | None = None,
        response_format: ResponseFormatParam | None = None,
        tools: Iterable[ToolParam] | None = None,
        tool_choice: Literal["auto", "none", "required"] | ToolChoiceParam | None = None,
        parallel_tool_calls: bool | None = None,
        stream: bool = False,
        timeout: float | None = None,
        idempotency_key: str | None = None,
        extra_headers: Mapping[str, str] | None = None,
        extra_body: Mapping[str, object] | None = None,
    ) -> Completion | Stream:
        """Answers the conversation in `messages`, rendered with the model's chat template.

        `timeout` (seconds) overrides the client's deadline for this call. `idempotency_key`
        (a fresh UUID when omitted) is sent unchanged on every retry, so the gateway runs and
        bills the request once; pass your own to make retries of your own idempotent too.
        `priority="batch"` yields to interactive traffic; `ignore_eos` generates past the
        end-of-sequence token (exactly `max_tokens` tokens, for benchmarks). `n` (1 to 16)
        generates that many choices of the prompt (`Completion.choices`; each streamed chunk names its
        choice by `index`); `prompt_cache_key` sends requests that share it to the same prefill
        worker, so that their common prefix is found in its cache. `max_tokens` defaults to the rest
        of the model's context.

        `presence_penalty` and `frequency_penalty` (-2 to 2) lower the logit of each token by that much
        once it appears in the output, and by that much per occurrence; `logit_bias` ({token id: -100
        to 100}) adds to tokens' logits. `logprobs=True` returns each output token's logprob
        (`Choice.logprobs`, `CompletionChunk.logprobs`), with the `top_logprobs` (0 to 20) most likely
        tokens; both are taken after logit_bias and the penalties, before temperature, top_k and top_p.

        `response_format` ({"type": "json_object"} or {"type": "json_schema", "json_schema": {"name",
        "schema"}}) makes the answer JSON that follows it, always. `tools` (OpenAI's shape) are shown to
        the model; `tool_choice` "auto" (the default) lets it answer or call them, "required" or
        {"type": "function", "function": {"name": ...}} makes it call, "none" answer; calls come back as
        `Choice.tool_calls` (finish_reason "tool_calls"; "stop" for a named function, as OpenAI's), their
        arguments following the tool's parameters schema. `parallel_tool_calls=False` allows one call per answer.

        `extra_headers` go as extra gRPC metadata (names in lower case; a name the client sends too, such
        as authorization, takes this value). `extra_body` sets fields of the API's GenerateRequest by
        name (over the arguments' values); gRPC carries only the contract's fields, so a name it lacks is
        refused with ValueError before sending, never dropped.
        """
        request = generate_request(
            model=model,
            input_field=chat_input(messages),
            idempotency_key=new_idempotency_key() if idempotency_key is None else idempotency_key,
            extra_body=extra_body,
            max_tokens=max_tokens,
            temperature=temperature,
            top_p=top_p,
            top_k=top_k,
            seed=seed,
            stop=stop,
            priority=priority,
            ignore_eos=ignore_eos,
            n=n,
            prompt_cache_key=prompt_cache_key,
            presence_penalty=presence_penalty,
            frequency_penalty=frequency_penalty,
            logit_bias=logit_bias,
            logprobs=bool(logprobs),
            top_logprobs=top_logprobs,
            structured=structured_input(response_format, tools, tool_choice, parallel_tool_calls),
        )
        return generate(self._client, request, stream=stream, timeout=timeout, extra_headers=extra_headers)


class AsyncChatCompletions:
    def __init__(self, client: AsyncClient) -> None:
        self._client = client

    @cached_property
    def with_raw_response(self) -> AsyncChatCompletionsWithRawResponse:
        return AsyncChatCompletionsWithRawResponse(self)

    @overload
    async def create(
        self,
        *,
        model: str,
        messages: Iterable[ChatMessageParam],
        max_tokens: int | None = None,
        temperature: float | None = None,
        top_p: float | None = None,
        top_k: int | None = None,
        seed: int | None = None,
        stop: str | Sequence[str] | None = None,
        priority: Priority = "interactive",
        ignore_eos: bool = False,
        n: int | None = None,
        prompt_cache_key: str | None = None,
        presence_penalty: float | None = None,
        frequency_penalty: float | None = None,
        logit_bias: Mapping[int | str, float] | None = None,
        logprobs: bool | None = None,
        top_logprobs: int | None = None,
        response_format: ResponseFormatParam | None = None,
        tools: Iterable[ToolParam] | None = None,
        tool_choice: Literal["auto", "none", "required"] | ToolChoiceParam | None = None,
        parallel_tool_calls: bool | None = None,
        stream: Literal[False] = False,
        timeout: float | None = None,
        idempotency_key: str | None = None,
        extra_headers: Mapping[str, str] | None = None,
        extra_body: Mapping[str, object] | None = None,
    ) -> Completion: ...

    @overload
    async def create(
        self,
        *,
        model: str,
        messages: Iterable[ChatMessageParam],
        max_tokens: int | None = None,
        temperature: float | None = None,
        top_p: float | None = None,
        top_k: int | None = None,
        seed: int | None = None,
        stop: str | Sequence[str] | None = None,
        priority: Priority = "interactive",
        ignore_eos: bool = False,
        n: int | None = None,
        prompt_cache_key: str | None = None,
        presence_penalty: float | None = None,
        frequency_penalty: float | None = None,
        logit_bias: Mapping[int | str, float] | None = None,
        logprobs: bool | None = None,
        top_logprobs: int | None = None,
        response_format: ResponseFormatParam | None = None,
        tools: Iterable[ToolParam] | None = None,
        tool_choice: Literal["auto", "none", "required"] | ToolChoiceParam | None = None,
        parallel_tool_calls: bool | None = None,
        stream: Literal[True],
        timeout: float | None = None,
        idempotency_key: str | None = None,
        extra_headers: Mapping[str, str] | None = None,
        extra_body: Mapping[str, object] | None = None,
    ) -> AsyncStream: ...

    async def create(
        self,
        *,
        model: str,
        messages: Iterable[ChatMessageParam],
        max_tokens: int | None = None,
        temperature: float | None = None,
        top_p: float | None = None,
        top_k: int | None = None,
        seed: int | None = None,
        stop: str | Sequence[str] | None = None,
        priority: Priority = "interactive",
        ignore_eos: bool = False,
        n: int | None = None,
        prompt_cache_key: str | None = None,
        presence_penalty: float | None = None,
        frequency_penalty: float | None = None,
        logit_bias: Mapping[int | str, float] | None = None,
        logprobs: bool | None = None,
        top_logprobs: int | None = None,
        response_format: ResponseFormatParam | None = None,
        tools: Iterable[ToolParam] | None = None,
        tool_choice: Literal["auto", "none", "required"] | ToolChoiceParam | None = None,
        parallel_tool_calls: bool | None = None,
        stream: bool = False,
        timeout: float | None = None,
        idempotency_key: str | None = None,
        extra_headers: Mapping[str, str] | None = None,
        extra_body: Mapping[str, object] | None = None,
    ) -> Completion | AsyncStream:
        """The asyncio twin of `ChatCompletions.create`."""
        request = generate_request(
            model=model,
            input_field=chat_input(messages),
            idempotency_key=new_idempotency_key() if idempotency_key is None else idempotency_key,
            extra_body=extra_body,
            max_tokens=max_tokens,
            temperature=temperature,
            top_p=top_p,
            top_k=top_k,
            seed=seed,
            stop=stop,
            priority=priority,
            ignore_eos=ignore_eos,
            n=n,
            prompt_cache_key=prompt_cache_key,
            presence_penalty=presence_penalty,
            frequency_penalty=frequency_penalty,
            logit_bias=logit_bias,
            logprobs=bool(logprobs),
            top_logprobs=top_logprobs,
            structured=structured_input(response_format, tools, tool_choice, parallel_tool_calls),
        )
        return await generate_async(self._client, request, stream=stream, timeout=timeout, extra_headers=extra_headers)


class ChatCompletionsWithRawResponse:
    def __init__(self, completions: ChatCompletions) -> None:
        self.create = to_raw_response_wrapper(completions.create)


class AsyncChatCompletionsWithRawResponse:
    def __init__(self, completions: AsyncChatCompletions) -> None:
        self.create = async_to_raw_response_wrapper(completions.create)


class Chat:
    def __init__(self, client: Client) -> None:
        self.completions = ChatCompletions(client)


class AsyncChat:
    def __init__(self, client: AsyncClient) -> None:
        self.completions = AsyncChatCompletions(client)
