from __future__ import annotations

from functools import cached_property
from typing import Literal, Unpack, overload

from diptych_proto.v1 import inference_pb2 as pb

from .._convert import prompt_input
from .._response import (
    async_to_raw_response_wrapper,
    async_to_streamed_grpc_response_wrapper,
    to_raw_response_wrapper,
    to_streamed_grpc_response_wrapper,
)
from .._streaming import AsyncStream, Stream
from ..types import Completion, CompletionCreateParams
from ._connections import GatewayConnection
from ._generate import create_request, generate, generate_async
from ._keyword_parameters import KeywordParameters

__all__ = ["AsyncCompletions", "Completions"]

_CREATE_PARAMETERS = KeywordParameters(CompletionCreateParams, priority="interactive", ignore_eos=False)


class Completions:
    def __init__(self, client: GatewayConnection) -> None:
        self._client = client

    @cached_property
    def with_raw_response(self) -> CompletionsWithRawResponse:
        """`create` answering an `APIResponse`: the gateway's metadata (`headers`, `request_id`, `rate_limits`)
        and `parse()`, the usual result."""
        return CompletionsWithRawResponse(self)

    @cached_property
    def with_streaming_response(self) -> CompletionsWithStreamingResponse:
        """`create` in a `with` block, answering an `APIResponse`: the gateway's gRPC initial metadata as `headers`,
        and `parse()`, the usual result (a `Stream` with `stream=True`, closed, so cancelled, when the block
        ends). gRPC answers protobuf messages, not an HTTP body: there are no bytes or lines to iterate."""
        return CompletionsWithStreamingResponse(self)

    @overload
    def create(self, *, stream: Literal[False] = False, **params: Unpack[CompletionCreateParams]) -> Completion: ...

    @overload
    def create(self, *, stream: Literal[True], **params: Unpack[CompletionCreateParams]) -> Stream: ...

    @_CREATE_PARAMETERS.expand
    def create(self, *, stream: bool = False, **params: Unpack[CompletionCreateParams]) -> Completion | Stream:
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
        refused with ValueError before sending, never dropped. gRPC has no query string: a non-empty
        `extra_query` is refused too.

        OpenAI's `max_completion_tokens` is `max_tokens` by its newer name; `user` (your end user's id) labels
        the request in usage. `stream_options` (with `stream=True`) may ask for usage, which the stream's last
        chunk always carries, and only that chunk: `include_usage=False` and `continuous_usage_stats=True`
        are refused.
        """
        arguments = _CREATE_PARAMETERS.complete(params)
        request = _completion_request(arguments, stream=stream)
        return generate(
            self._client, request, stream=stream, timeout=arguments["timeout"], extra_headers=arguments["extra_headers"]
        )


class AsyncCompletions:
    def __init__(self, client: GatewayConnection) -> None:
        self._client = client

    @cached_property
    def with_raw_response(self) -> AsyncCompletionsWithRawResponse:
        return AsyncCompletionsWithRawResponse(self)

    @cached_property
    def with_streaming_response(self) -> AsyncCompletionsWithStreamingResponse:
        return AsyncCompletionsWithStreamingResponse(self)

    @overload
    async def create(
        self, *, stream: Literal[False] = False, **params: Unpack[CompletionCreateParams]
    ) -> Completion: ...

    @overload
    async def create(self, *, stream: Literal[True], **params: Unpack[CompletionCreateParams]) -> AsyncStream: ...

    @_CREATE_PARAMETERS.expand
    async def create(
        self, *, stream: bool = False, **params: Unpack[CompletionCreateParams]
    ) -> Completion | AsyncStream:
        """The asyncio twin of `Completions.create`."""
        arguments = _CREATE_PARAMETERS.complete(params)
        request = _completion_request(arguments, stream=stream)
        return await generate_async(
            self._client, request, stream=stream, timeout=arguments["timeout"], extra_headers=arguments["extra_headers"]
        )


def _completion_request(arguments: CompletionCreateParams, *, stream: bool) -> pb.GenerateRequest:
    return create_request(
        arguments,
        prompt_input(arguments["prompt"]),
        stream=stream,
        logprobs=arguments["logprobs"] is not None,
        top_logprobs=arguments["logprobs"],
    )


class CompletionsWithRawResponse:
    def __init__(self, completions: Completions) -> None:
        self.create = to_raw_response_wrapper(completions.create)


class AsyncCompletionsWithRawResponse:
    def __init__(self, completions: AsyncCompletions) -> None:
        self.create = async_to_raw_response_wrapper(completions.create)


class CompletionsWithStreamingResponse:
    def __init__(self, completions: Completions) -> None:
        self.create = to_streamed_grpc_response_wrapper(completions.create)


class AsyncCompletionsWithStreamingResponse:
    def __init__(self, completions: AsyncCompletions) -> None:
        self.create = async_to_streamed_grpc_response_wrapper(completions.create)
