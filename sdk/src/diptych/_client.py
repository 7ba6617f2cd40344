"""The synchronous and asyncio clients and their configuration."""

from __future__ import annotations

import copy
import os
from abc import ABC, abstractmethod
from types import TracebackType
from typing import Final, Self

from ._errors import AuthenticationError
from ._gateway_http import DEFAULT_HTTP_URL, GatewayHttpTransport
from ._http import DEFAULT_ADMIN_URL, AdminTransport
from ._transport import DEFAULT_BASE_URL, AsyncTransport, SyncTransport, auth_metadata, parse_base_urls
from .resources import AsyncChat, AsyncCompletions, AsyncModels, Chat, Completions, Models
from .resources.admin import Admin, AsyncAdmin
from .resources.batches import AsyncBatches, AsyncFiles, Batches, Files
from .resources.responses import AsyncResponses, Responses
from .types import NOT_GIVEN, NotGiven

__all__ = ["DEFAULT_MAX_RETRIES", "DEFAULT_STREAM_IDLE_TIMEOUT", "DEFAULT_TIMEOUT", "AsyncClient", "Client"]

DEFAULT_TIMEOUT: Final = 600.0
DEFAULT_MAX_RETRIES: Final = 2
DEFAULT_STREAM_IDLE_TIMEOUT: Final = 60.0


_NotGiven = NotGiven
_NOT_GIVEN: Final = NOT_GIVEN


class _BaseClient(ABC):
    api_key: str
    base_url: str
    admin_url: str
    http_url: str
    timeout: float | None
    max_retries: int
    stream_idle_timeout: float | None

    def __init__(
        self,
        *,
        api_key: str | None,
        base_url: str | None,
        admin_url: str | None,
        timeout: float | None,
        max_retries: int,
        stream_idle_timeout: float | None,
        http_url: str | None = None,
    ) -> None:
        api_key = api_key if api_key is not None else os.environ.get("DIPTYCH_API_KEY")
        if not api_key:
            raise AuthenticationError(
                "The api_key client option must be set either by passing api_key to the client "
                "or by setting the DIPTYCH_API_KEY environment variable"
            )
        self.api_key = api_key
        self.base_url = base_url or os.environ.get("DIPTYCH_BASE_URL") or DEFAULT_BASE_URL
        self._endpoints = parse_base_urls(self.base_url)
        self._metadata = auth_metadata(api_key)
        self._admin_transport = AdminTransport(
            admin_url or os.environ.get("DIPTYCH_ADMIN_URL") or DEFAULT_ADMIN_URL, api_key
        )
        self.admin_url = self._admin_transport.admin_url
        self._http_transport = GatewayHttpTransport(
            http_url or os.environ.get("DIPTYCH_HTTP_URL") or DEFAULT_HTTP_URL, api_key
        )
        self.http_url = self._http_transport.http_url
        self._set_options(timeout, max_retries, stream_idle_timeout)

    def with_options(
        self,
        *,
        timeout: float | _NotGiven | None = _NOT_GIVEN,
        max_retries: int | _NotGiven = _NOT_GIVEN,
        stream_idle_timeout: float | _NotGiven | None = _NOT_GIVEN,
    ) -> Self:
        """A client with other defaults that shares this one's connection (closing either closes it).

        `None` for a timeout means none.
        """
        clone = copy.copy(self)
        clone._set_options(
            self.timeout if isinstance(timeout, _NotGiven) else timeout,
            self.max_retries if isinstance(max_retries, _NotGiven) else max_retries,
            self.stream_idle_timeout if isinstance(stream_idle_timeout, _NotGiven) else stream_idle_timeout,
        )
        clone._bind_resources()
        return clone

    def _set_options(self, timeout: float | None, max_retries: int, stream_idle_timeout: float | None) -> None:
        for name, seconds in (("timeout", timeout), ("stream_idle_timeout", stream_idle_timeout)):
            if seconds is not None and (
                isinstance(seconds, bool) or not isinstance(seconds, (int, float)) or not seconds > 0
            ):
                raise ValueError(f"{name} must be a positive number of seconds or None, not {seconds!r}")
        if isinstance(max_retries, bool) or not isinstance(max_retries, int) or max_retries < 0:
            raise ValueError(f"max_retries must be a non-negative integer, not {max_retries!r}")
        self.timeout = timeout
        self.max_retries = max_retries
        self.stream_idle_timeout = stream_idle_timeout

    @abstractmethod
    def _bind_resources(self) -> None:
        """Creates the resource namespaces (completions, chat, models, admin) bound to this client."""


class Client(_BaseClient):
    """A client of the Diptych API. Thread-safe; holds one gRPC channel per gateway.

    `api_key` defaults to $DIPTYCH_API_KEY, `base_url` (the gateway) to $DIPTYCH_BASE_URL then
    grpc://127.0.0.1:50051, `admin_url` (the control plane's REST API, for `client.admin`) to
    $DIPTYCH_ADMIN_URL then http://127.0.0.1:8000, `http_url` (the gateway's HTTP API, for `client.responses`)
    to $DIPTYCH_HTTP_URL then http://127.0.0.1:8080/v1. `timeout` is each call's deadline in seconds,
    `stream_idle_timeout` the longest wait for the next streamed message (None: no limit).
    """

    completions: Completions
    chat: Chat
    models: Models
    admin: Admin
    files: Files
    batches: Batches
    responses: Responses

    def __init__(
        self,
        *,
        api_key: str | None = None,
        base_url: str | None = None,
        admin_url: str | None = None,
        timeout: float | None = DEFAULT_TIMEOUT,
        max_retries: int = DEFAULT_MAX_RETRIES,
        stream_idle_timeout: float | None = DEFAULT_STREAM_IDLE_TIMEOUT,
        http_url: str | None = None,
    ) -> None:
        super().__init__(
            api_key=api_key,
            base_url=base_url,
            admin_url=admin_url,
            timeout=timeout,
            max_retries=max_retries,
            stream_idle_timeout=stream_idle_timeout,
            http_url=http_url,
        )
        self._transport = SyncTransport(self._endpoints)
        self._bind_resources()

    def _bind_resources(self) -> None:
        self.completions = Completions(self)
        self.chat = Chat(self)
        self.models = Models(self)
        self.admin = Admin(self)
        self.files = Files(self)
        self.batches = Batches(self)
        self.responses = Responses(self)

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
    admin: AsyncAdmin
    files: AsyncFiles
    batches: AsyncBatches
    responses: AsyncResponses

    def __init__(
        self,
        *,
        api_key: str | None = None,
        base_url: str | None = None,
        admin_url: str | None = None,
        timeout: float | None = DEFAULT_TIMEOUT,
        max_retries: int = DEFAULT_MAX_RETRIES,
        stream_idle_timeout: float | None = DEFAULT_STREAM_IDLE_TIMEOUT,
        http_url: str | None = None,
    ) -> None:
        super().__init__(
            api_key=api_key,
            base_url=base_url,
            admin_url=admin_url,
            timeout=timeout,
            max_retries=max_retries,
            stream_idle_timeout=stream_idle_timeout,
            http_url=http_url,
        )
        self._transport = AsyncTransport(self._endpoints)
        self._bind_resources()

    def _bind_resources(self) -> None:
        self.completions = AsyncCompletions(self)
        self.chat = AsyncChat(self)
        self.models = AsyncModels(self)
        self.admin = AsyncAdmin(self)
        self.files = AsyncFiles(self)
        self.batches = AsyncBatches(self)
        self.responses = AsyncResponses(self)

    async def close(self) -> None:
        await self._transport.close()

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.close()
