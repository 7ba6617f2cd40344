from __future__ import annotations

from functools import cached_property
from typing import Literal, Unpack, overload

from diptych_proto.v1 import inference_pb2 as pb

from .._convert import chat_input, check_chat_only_options, structured_input
from .._response import (
    async_to_raw_response_wrapper,
    async_to_streamed_grpc_response_wrapper,
    to_raw_response_wrapper,
    to_streamed_grpc_response_wrapper,
)
from .._streaming import AsyncStream, Stream
from ..types import ChatCompletionCreateParams, Completion
from ._connections import GatewayConnection
from ._generate import create_request, generate, generate_async
from ._keyword_parameters import KeywordParameters

__all__ = ["AsyncChat", "AsyncChatCompletions", "Chat", "ChatCompletions"]

_CREATE_PARAMETERS = KeywordParameters(ChatCompletionCreateParams, priority="interactive", ignore_eos=False)


class ChatCompletions:
    def __init__(self, client: GatewayConnection) -> None:
        self._client = client

    @cached_property
    def with_raw_response(self) -> ChatCompletionsWithRawResponse:
        """`create` answering an `APIResponse`: the gateway's metadata (`headers`, `request_id`, `rate_limits`)
        and `parse()`, the usual result."""
        return ChatCompletionsWithRawResponse(self)

    @cached_property
    def with_streaming_response(self) -> ChatCompletionsWithStreamingResponse:
        """`create` in a `with` block, answering an `APIResponse`: the gateway's gRPC initial metadata as `headers`,
        and `parse()`, the usual result (a `Stream` with `stream=True`, closed, so cancelled, when the block
        ends). gRPC answers protobuf messages, not an HTTP body: there are no bytes or lines to iterate."""
        return ChatCompletionsWithStreamingResponse(self)

    @overload
    def create(self, *, stream: Literal[False] = False, **params: Unpack[ChatCompletionCreateParams]) -> Completion: ...

    @overload
    def create(self, *, stream: Literal[True], **params: Unpack[ChatCompletionCreateParams]) -> Stream: ...

    @_CREATE_PARAMETERS.expand
    def create(self, *, stream: bool = False, **params: Unpack[ChatCompletionCreateParams]) -> Completion | Stream:
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
        refused with ValueError before sending, never dropped. gRPC has no query string: a non-empty
        `extra_query` is refused too.

        OpenAI's `max_completion_tokens` is `max_tokens` by its newer name; `user` (your end user's id) labels
        the request in usage. `stream_options` (with `stream=True`) may ask for usage, which the stream's last
        chunk always carries, and only that chunk: `include_usage=False` and `continuous_usage_stats=True`
        are refused. `metadata` may be empty and `service_tier` "auto" or "default" (completions are
        not stored, and every request is served at the default tier); other values are refused.
        """
        arguments = _CREATE_PARAMETERS.complete(params)
        request = _chat_completion_request(arguments, stream=stream)
        return generate(
            self._client, request, stream=stream, timeout=arguments["timeout"], extra_headers=arguments["extra_headers"]
        )


class AsyncChatCompletions:
    def __init__(self, client: GatewayConnection) -> None:
        self._client = client

    @cached_property
    def with_raw_response(self) -> AsyncChatCompletionsWithRawResponse:
        return AsyncChatCompletionsWithRawResponse(self)

    @cached_property
    def with_streaming_response(self) -> AsyncChatCompletionsWithStreamingResponse:
        return AsyncChatCompletionsWithStreamingResponse(self)

    @overload
    async def create(
        self, *, stream: Literal[False] = False, **params: Unpack[ChatCompletionCreateParams]
    ) -> Completion: ...

    @overload
    async def create(self, *, stream: Literal[True], **params: Unpack[ChatCompletionCreateParams]) -> AsyncStream: ...

    @_CREATE_PARAMETERS.expand
    async def create(
        self, *, stream: bool = False, **params: Unpack[ChatCompletionCreateParams]
    ) -> Completion | AsyncStream:
        """The asyncio twin of `ChatCompletions.create`."""
        arguments = _CREATE_PARAMETERS.complete(params)
        request = _chat_completion_request(arguments, stream=stream)
        return await generate_async(
            self._client, request, stream=stream, timeout=arguments["timeout"], extra_headers=arguments["extra_headers"]
        )


def _chat_completion_request(arguments: ChatCompletionCreateParams, *, stream: bool) -> pb.GenerateRequest:
    check_chat_only_options(arguments["metadata"], arguments["service_tier"])
    structured = structured_input(
        arguments["response_format"], arguments["tools"], arguments["tool_choice"], arguments["parallel_tool_calls"]
    )
    return create_request(
        arguments,
        chat_input(arguments["messages"]),
        stream=stream,
        logprobs=bool(arguments["logprobs"]),
        top_logprobs=arguments["top_logprobs"],
        structured=structured,
    )


class ChatCompletionsWithRawResponse:
    def __init__(self, completions: ChatCompletions) -> None:
        self.create = to_raw_response_wrapper(completions.create)


class AsyncChatCompletionsWithRawResponse:
    def __init__(self, completions: AsyncChatCompletions) -> None:
        self.create = async_to_raw_response_wrapper(completions.create)


class Chat:
    def __init__(self, client: GatewayConnection) -> None:
        self.completions = ChatCompletions(client)


class AsyncChat:
    def __init__(self, client: GatewayConnection) -> None:
        self.completions = AsyncChatCompletions(client)


class ChatCompletionsWithStreamingResponse:
    def __init__(self, completions: ChatCompletions) -> None:
        self.create = to_streamed_grpc_response_wrapper(completions.create)


class AsyncChatCompletionsWithStreamingResponse:
    def __init__(self, completions: AsyncChatCompletions) -> None:
        self.create = async_to_streamed_grpc_response_wrapper(completions.create)
