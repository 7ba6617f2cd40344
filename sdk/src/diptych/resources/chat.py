from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Literal, overload

from .._convert import chat_input, generate_request, new_idempotency_key
from .._streaming import AsyncStream, Stream
from ..types import ChatMessageParam, Completion, Priority
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
        priority: Priority = "interactive",
        ignore_eos: bool = False,
        stream: Literal[False] = False,
        timeout: float | None = None,
        idempotency_key: str | None = None,
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
        stream: Literal[True],
        timeout: float | None = None,
        idempotency_key: str | None = None,
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
        stream: bool = False,
        timeout: float | None = None,
        idempotency_key: str | None = None,
    ) -> Completion | Stream:
        """Answers the conversation in `messages`, rendered with the model's chat template.

        `timeout` (seconds) overrides the client's deadline for this call. `idempotency_key`
        (a fresh UUID when omitted) is sent unchanged on every retry, so the gateway runs and
        bills the request once; pass your own to make retries of your own idempotent too.
        `priority="batch"` yields to interactive traffic; `ignore_eos` generates past the
        end-of-sequence token (exactly `max_tokens` tokens, for benchmarks).
        """
        request = generate_request(
            model=model,
            input_field=chat_input(messages),
            idempotency_key=new_idempotency_key() if idempotency_key is None else idempotency_key,
            max_tokens=max_tokens,
            temperature=temperature,
            top_p=top_p,
            top_k=top_k,
            seed=seed,
            stop=stop,
            priority=priority,
            ignore_eos=ignore_eos,
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
        priority: Priority = "interactive",
        ignore_eos: bool = False,
        stream: Literal[False] = False,
        timeout: float | None = None,
        idempotency_key: str | None = None,
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
        stream: Literal[True],
        timeout: float | None = None,
        idempotency_key: str | None = None,
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
        stream: bool = False,
        timeout: float | None = None,
        idempotency_key: str | None = None,
    ) -> Completion | AsyncStream:
        """The asyncio twin of `ChatCompletions.create`."""
        request = generate_request(
            model=model,
            input_field=chat_input(messages),
            idempotency_key=new_idempotency_key() if idempotency_key is None else idempotency_key,
            max_tokens=max_tokens,
            temperature=temperature,
            top_p=top_p,
            top_k=top_k,
            seed=seed,
            stop=stop,
            priority=priority,
            ignore_eos=ignore_eos,
        )
        return await generate_async(self._client, request, stream=stream, timeout=timeout)


class Chat:
    def __init__(self, client: Client) -> None:
        self.completions = ChatCompletions(client)


class AsyncChat:
    def __init__(self, client: AsyncClient) -> None:
        self.completions = AsyncChatCompletions(client)
