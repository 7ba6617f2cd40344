from __future__ import annotations

from collections.abc import Mapping, Sequence
from functools import cached_property
from typing import TYPE_CHECKING, Literal, overload

from .._convert import generate_request, new_idempotency_key, prompt_input
from .._response import async_to_raw_response_wrapper, to_raw_response_wrapper
from .._streaming import AsyncStream, Stream
from ..types import Completion, Priority
from ._generate import generate, generate_async

if TYPE_CHECKING:
    from .._client import AsyncClient, Client

__all__ = ["Completions", "AsyncCompletions"]


class Completions:
    def __init__(self, client: Client) -> None:
        self._client = client

    @cached_property
    def with_raw_response(self) -> CompletionsWithRawResponse:
        """`create` answering an `APIResponse`: the gateway's metadata (`headers`, `request_id`, `rate_limits`)
        and `parse()`, the usual result."""
        return CompletionsWithRawResponse(self)

    @overload
    def create(
        self,
        *,
        model: str,
        prompt: str | Sequence[int],
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
        logprobs: int | None = None,
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
        prompt: str | Sequence[int],
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
        logprobs: int | None = None,
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
        prompt: str | Sequence[int],
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
        logprobs: int | None = None,
        stream: bool = False,
        timeout: float | None = None,
        idempotency_key: str | None = None,
        extra_headers: Mapping[str, str] | None = None,
        extra_body: Mapping[str, object] | None = None,
    ) -> Completion | Stream:
        """Completes `prompt`, given as text or as token ids.

        `timeout` (seconds) overrides the client's deadline for this call. `idempotency_key`
        (a fresh UUID when omitted) is sent unchanged on every retry, so the gateway runs and
        bills the request once; pass your own to make retries of your own idempotent too.
        `priority="batch"` yields to interactive traffic; `ignore_eos` generates past the
        end-of-sequence token (exactly `max_tokens` tokens, for benchmarks). `n` (1 to 16)
        generates that many choices of the prompt (`Completion.choices`; each streamed chunk names its
        choice by `index`); `prompt_cache_key` sends requests that share it to the same prefill
        worker, so that their common prefix is found in its cache. `max_tokens` defaults to 16.

        `presence_penalty` and `frequency_penalty` (-2 to 2) lower the logit of each token by that much
        once it appears in the output, and by that much per occurrence; `logit_bias` ({token id: -100
        to 100}) adds to tokens' logits. `logprobs` (0 to 5) returns each output token's logprob
        (`Choice.logprobs`, `CompletionChunk.logprobs`) with that many of the most likely tokens; both
        are taken after logit_bias and the penalties, before temperature, top_k and top_p.

        `extra_headers` go as extra gRPC metadata (names in lower case; a name the client sends too, such
        as authorization, takes this value). `extra_body` sets fields of the API's GenerateRequest by
        name (over the arguments' values); gRPC carries only the contract's fields, so a name it lacks is
        refused with ValueError before sending, never dropped.
        """
        request = generate_request(
            model=model,
            input_field=prompt_input(prompt),
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
            logprobs=logprobs is not None,
            top_logprobs=logprobs,
        )
        return generate(self._client, request, stream=stream, timeout=timeout, extra_headers=extra_headers)


class AsyncCompletions:
    def __init__(self, client: AsyncClient) -> None:
        self._client = client

    @cached_property
    def with_raw_response(self) -> AsyncCompletionsWithRawResponse:
        return AsyncCompletionsWithRawResponse(self)

    @overload
    async def create(
        self,
        *,
        model: str,
        prompt: str | Sequence[int],
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
        logprobs: int | None = None,
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
        prompt: str | Sequence[int],
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
        logprobs: int | None = None,
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
        prompt: str | Sequence[int],
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
        logprobs: int | None = None,
        stream: bool = False,
        timeout: float | None = None,
        idempotency_key: str | None = None,
        extra_headers: Mapping[str, str] | None = None,
        extra_body: Mapping[str, object] | None = None,
    ) -> Completion | AsyncStream:
        """The asyncio twin of `Completions.create`."""
        request = generate_request(
            model=model,
            input_field=prompt_input(prompt),
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
            logprobs=logprobs is not None,
            top_logprobs=logprobs,
        )
        return await generate_async(self._client, request, stream=stream, timeout=timeout, extra_headers=extra_headers)


class CompletionsWithRawResponse:
    def __init__(self, completions: Completions) -> None:
        self.create = to_raw_response_wrapper(completions.create)


class AsyncCompletionsWithRawResponse:
    def __init__(self, completions: AsyncCompletions) -> None:
        self.create = async_to_raw_response_wrapper(completions.create)
