"""The synchronous and asyncio clients and their configuration."""

from __future__ import annotations

import copy
import os
from abc import ABC, abstractmethod
from types import TracebackType
from typing import Final, Self

from ._errors import AuthenticationError
from ._transport import DEFAULT_BASE_URL, AsyncTransport, SyncTransport, auth_metadata, parse_base_url
from .resources import AsyncChat, AsyncCompletions, AsyncModels, Chat, Completions, Models

__all__ = ["Client", "AsyncClient", "DEFAULT_TIMEOUT", "DEFAULT_MAX_RETRIES"]

DEFAULT_TIMEOUT: Final = 60.0
DEFAULT_MAX_RETRIES: Final = 2


class _NotGiven:
    def __repr__(self) -> str:
        return "NOT_GIVEN"


_NOT_GIVEN: Final = _NotGiven()


class _BaseClient(ABC):
    api_key: str
    base_url: str
    timeout: float | None
    max_retries: int

    def __init__(self, *, api_key: str | None, base_url: str | None, timeout: float | None, max_retries: int) -> None:
        api_key = api_key if api_key is not None else os.environ.get("DIPTYCH_API_KEY")
        if not api_key:
            raise AuthenticationError(
                "The api_key client option must be set either by passing api_key to the client "
                "or by setting the DIPTYCH_API_KEY environment variable"
            )
        self.api_key = api_key
        self.base_url = base_url or os.environ.get("DIPTYCH_BASE_URL") or DEFAULT_BASE_URL
        self._endpoint = parse_base_url(self.base_url)
        self._metadata = auth_metadata(api_key)
        self._set_options(timeout, max_retries)

    def with_options(
        self, *, timeout: float | None | _NotGiven = _NOT_GIVEN, max_retries: int | _NotGiven = _NOT_GIVEN
    ) -> Self:
        """A client with other defaults that shares this one's channel (closing either closes it).

        `timeout=None` here means no deadline.
        """
        clone = copy.copy(self)
        clone._set_options(
            self.timeout if isinstance(timeout, _NotGiven) else timeout,
            self.max_retries if isinstance(max_retries, _NotGiven) else max_retries,
        )
        clone._bind_resources()
        return clone

    def _set_options(self, timeout: float | None, max_retries: int) -> None:
        if timeout is not None and not timeout > 0:
            raise ValueError(f"timeout must be a positive number of seconds or None, not {timeout!r}")
        if isinstance(max_retries, bool) or not isinstance(max_retries, int) or max_retries < 0:
            raise ValueError(f"max_retries must be a non-negative integer, not {max_retries!r}")
        self.timeout = timeout
        self.max_retries = max_retries

    @abstractmethod
    def _bind_resources(self) -> None:
        """Creates the resource namespaces (completions, chat, models) bound to this client."""


class Client(_BaseClient):
    """A client of the Diptych gateway. Thread-safe; holds one gRPC channel.

    `api_key` defaults to $DIPTYCH_API_KEY and `base_url` to $DIPTYCH_BASE_URL, then
    grpc://127.0.0.1:50051. `timeout` is each call's deadline in seconds (None: none).
    """

    completions: Completions
    chat: Chat
    models: Models

    def __init__(
        self,
        *,
        api_key: str | None = None,
        base_url: str | None = None,
        timeout: float | None = DEFAULT_TIMEOUT,
        max_retries: int = DEFAULT_MAX_RETRIES,
    ) -> None:
        super().__init__(api_key=api_key, base_url=base_url, timeout=timeout, max_retries=max_retries)
        self._transport = SyncTransport(self._endpoint)
        self._bind_resources()

    def _bind_resources(self) -> None:
        self.completions = Completions(self)
        self.chat = Chat(self)
        self.models = Models(self)

    def close(self) -> None:
        self._transport.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()


class AsyncClient(_BaseClient):
    """The asyncio twin of `Client`, over grpc.aio. Use it from one event loop."""

    completions: AsyncCompletions
    chat: AsyncChat
    models: AsyncModels

    def __init__(
        self,
        *,
        api_key: str | None = None,
        base_url: str | None = None,
        timeout: float | None = DEFAULT_TIMEOUT,
        max_retries: int = DEFAULT_MAX_RETRIES,
    ) -> None:
        super().__init__(api_key=api_key, base_url=base_url, timeout=timeout, max_retries=max_retries)
        self._transport = AsyncTransport(self._endpoint)
        self._bind_resources()

    def _bind_resources(self) -> None:
        self.completions = AsyncCompletions(self)
        self.chat = AsyncChat(self)
        self.models = AsyncModels(self)

    async def close(self) -> None:
        await self._transport.close()

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.close()
