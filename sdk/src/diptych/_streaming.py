"""Streams of parsed responses over a server-streaming call, sync and asyncio."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable, Iterator
from types import TracebackType
from typing import Generic, Self, TypeVar

import grpc
import grpc.aio

from ._errors import APIResponseValidationError, error_from_rpc
from ._proto.v1 import inference_pb2 as pb

__all__ = ["Stream", "AsyncStream"]

T = TypeVar("T")

_INCOMPLETE = "The response stream ended before its final message"


class Stream(Generic[T]):
    """Chunks as the gateway produces them.

    Iterate it, ideally inside `with`. Leaving early (break, `close()`, the end
    of the `with` block) cancels the call so the gateway stops generating.
    """

    def __init__(
        self,
        call: grpc.Call,
        first_message: pb.GenerateResponse | None,
        *,
        parse: Callable[[pb.GenerateResponse], T],
        request_id: str,
    ) -> None:
        self.request_id = request_id
        self._call = call
        self._first_message = first_message
        self._parse = parse
        self._closed = False
        self._chunks = self._read_chunks()

    def __next__(self) -> T:
        return next(self._chunks)

    def __iter__(self) -> Iterator[T]:
        # A fresh generator per loop: when a `for` loop breaks, CPython finalizes it
        # at once, and its `finally` cancels the call.
        try:
            yield from self._chunks
        finally:
            self.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    def close(self) -> None:
        """Cancels the call if it is still running; idempotent."""
        self._closed = True
        self._call.cancel()

    def _read_chunks(self) -> Iterator[T]:
        finished = False
        while not self._closed:
            if self._first_message is not None:
                message, self._first_message = self._first_message, None
            else:
                try:
                    message = next(self._call)
                except StopIteration:
                    break
                except grpc.RpcError as rpc_error:
                    if self._closed:
                        return
                    raise error_from_rpc(rpc_error, request_id=self.request_id) from rpc_error
            finished = message.finish_reason != pb.FINISH_REASON_UNSPECIFIED
            yield self._parse(message)
        if not finished and not self._closed:
            raise APIResponseValidationError(_INCOMPLETE, request_id=self.request_id)


class AsyncStream(Generic[T]):
    """The asyncio twin of `Stream`: `async for` it, ideally inside `async with`."""

    def __init__(
        self,
        call: grpc.aio.UnaryStreamCall,
        first_message: pb.GenerateResponse | None,
        *,
        parse: Callable[[pb.GenerateResponse], T],
        request_id: str,
    ) -> None:
        self.request_id = request_id
        self._call = call
        self._first_message = first_message
        self._parse = parse
        self._closed = False
        self._chunks = self._read_chunks()

    async def __anext__(self) -> T:
        return await anext(self._chunks)

    async def __aiter__(self) -> AsyncIterator[T]:
        # asyncio finalizes an abandoned async generator soon after an `async for`
        # breaks out of it, and this `finally` then cancels the call.
        try:
            async for chunk in self._chunks:
                yield chunk
        finally:
            await self.close()

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.close()

    async def close(self) -> None:
        """Cancels the call if it is still running; idempotent."""
        self._closed = True
        self._call.cancel()

    async def _read_chunks(self) -> AsyncIterator[T]:
        finished = False
        while not self._closed:
            if self._first_message is not None:
                message, self._first_message = self._first_message, None
            else:
                try:
                    message = await self._call.read()
                except grpc.RpcError as rpc_error:
                    if self._closed:
                        return
                    raise error_from_rpc(rpc_error, request_id=self.request_id) from rpc_error
                if message is grpc.aio.EOF:
                    break
            finished = message.finish_reason != pb.FINISH_REASON_UNSPECIFIED
            yield self._parse(message)
        if not finished and not self._closed:
            raise APIResponseValidationError(_INCOMPLETE, request_id=self.request_id)
