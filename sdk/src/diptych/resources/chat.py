from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Literal, overload

from .._convert import chat_input, generate_request, new_request_id
from .._streaming import AsyncStream, Stream
from ..types import ChatMessageParam, Completion, CompletionChunk
from ._generate import generate, generate_async

if TYPE_CHECKING:
    from .._client import AsyncClient, Client

__all__ = ["Chat", "AsyncChat", "ChatCompletions", "AsyncChatCompletions"]


class ChatCompletions:
    def __init__(self, client: Client) -> None:
        self._client = client

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
        stream: Literal[False] = False,
        timeout: float | None = None,
        request_id: str | None = None,
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
        stream: Literal[True],
        timeout: float | None = None,
        request_id: str | None = None,
    ) -> Stream[CompletionChunk]: ...

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
        stream: bool = False,
        timeout: float | None = None,
        request_id: str | None = None,
    ) -> Completion | Stream[CompletionChunk]:
        """Answers the conversation in `messages`, rendered with the model's chat template.

        `timeout` (seconds) overrides the client's deadline for this call; `request_id`
        (generated when omitted) is sent unchanged on every retry, as the idempotency key.
        """
        request = generate_request(
            model=model,
            input_field=chat_input(messages),
            request_id=request_id or new_request_id(),
            max_tokens=max_tokens,
            temperature=temperature,
            top_p=top_p,
            top_k=top_k,
            seed=seed,
            stop=stop,
        )
        return generate(self._client, request, stream=stream, timeout=timeout)


class AsyncChatCompletions:
    def __init__(self, client: AsyncClient) -> None:
        self._client = client

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
        stream: Literal[False] = False,
        timeout: float | None = None,
        request_id: str | None = None,
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
        stream: Literal[True],
        timeout: float | None = None,
        request_id: str | None = None,
    ) -> AsyncStream[CompletionChunk]: ...

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
        stream: bool = False,
        timeout: float | None = None,
        request_id: str | None = None,
    ) -> Completion | AsyncStream[CompletionChunk]:
        """The asyncio twin of `ChatCompletions.create`."""
        request = generate_request(
            model=model,
            input_field=chat_input(messages),
            request_id=request_id or new_request_id(),
            max_tokens=max_tokens,
            temperature=temperature,
            top_p=top_p,
            top_k=top_k,
            seed=seed,
            stop=stop,
        )
        return await generate_async(self._client, request, stream=stream, timeout=timeout)


class Chat:
    def __init__(self, client: Client) -> None:
        self.completions = ChatCompletions(client)


class AsyncChat:
    def __init__(self, client: AsyncClient) -> None:
        self.completions = AsyncChatCompletions(client)
