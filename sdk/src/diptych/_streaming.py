"""Streams of completion chunks over a Generate call, sync and asyncio.

Both guard the call with an idle timeout: when no message arrives for
`stream_idle_timeout` seconds the call is cancelled and `APITimeoutError` raised,
so a silent gateway cannot hang the caller (the call's `timeout` bounds it as a whole).

A stream cut mid-way by a broken connection (its gateway died, say) is resumed: the SDK asks the gateways,
under the request's idempotency key, for what that execution handed over (`resume_request_id`), which the
gateway's next run stores as the key's answer, and yields the part the caller has not seen yet, its last
chunk with finish reason "interrupted" and the usage billed. It tries for up to RESUME_TIMEOUT_S while
the key is still held or the gateways unreachable; after that, or when nothing was stored,
`StreamInterruptedError` says so.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterator
from types import TracebackType
from typing import Self, TypeAlias

import grpc
import grpc.aio

from diptych_proto.v1 import inference_pb2 as pb

from ._convert import chunk_from_proto
from ._errors import (
    APIConnectionError,
    APIResponseValidationError,
    APITimeoutError,
    DiptychError,
    StreamInterruptedError,
    error_from_rpc,
)
from ._ratelimits import rate_limit_status
from ._retry import resume_delay
from .types import CompletionChunk, RateLimitStatus, Usage

__all__ = ["AsyncStream", "Stream"]

_INCOMPLETE = "The response stream ended before its final message"
RESUME_TIMEOUT_S = 60.0
# A sync unary-stream call: a grpc.Call that iterates its responses (a type grpc's stubs name for type checking only)
SyncCall: TypeAlias = "grpc._CallIterator[pb.GenerateResponse]"
AsyncCall: TypeAlias = grpc.aio.UnaryStreamCall[pb.GenerateRequest, pb.GenerateResponse]
SyncReopen = Callable[[str], SyncCall]  # opens the replay of an execution (its request id)
AsyncReopen = Callable[[str], AsyncCall]


class _StreamState:
    """What sync and async streams share: ids, usage and the end-of-stream checks."""

    def __init__(self, idle_timeout: float | None, idempotency_key: str) -> None:
        self.request_id: str | None = None
        """The gateway's id of this request, known from the first message on."""
        self.idempotency_key = idempotency_key
        self.usage: Usage | None = None
        """Set once the final chunk has been read."""
        self.rate_limits: RateLimitStatus | None = None
        """Where the caller stands with its rate limits after this request, known from the first message on."""
        self._idle_timeout = idle_timeout
        self._closed = False
        self._first: pb.GenerateResponse | None = None
        self._initial_metadata: tuple[tuple[str, str | bytes], ...] = ()
        self._seen_text = ""  # what the caller got of choice 0, to resume after
        self._seen_tokens = 0
        self._multiple_choices = False

    def _chunk(self, message: pb.GenerateResponse) -> CompletionChunk:
        chunk = chunk_from_proto(message)
        self.request_id = self.request_id or chunk.id or None
        self._multiple_choices = self._multiple_choices or message.index > 0
        self._seen_text += message.text
        self._seen_tokens += len(message.token_ids)
        if chunk.usage is not None and chunk.finish_reason is not None:
            self.usage = chunk.usage
        return chunk

    def _idle_error(self) -> APITimeoutError:
        return APITimeoutError(
            f"No message from the gateway for {self._idle_timeout:g} s (stream_idle_timeout); the call was cancelled",
            code="DEADLINE_EXCEEDED",
            request_id=self.request_id,
            idempotency_key=self.idempotency_key,
        )

    def _rpc_error(self, rpc_error: grpc.RpcError) -> DiptychError:
        return error_from_rpc(rpc_error, request_id=self.request_id, idempotency_key=self.idempotency_key)

    def _incomplete_error(self) -> APIResponseValidationError:
        return APIResponseValidationError(_INCOMPLETE, request_id=self.request_id, idempotency_key=self.idempotency_key)

    def _resumable(self, error: DiptychError) -> bool:
        """A connection broken mid-stream, of a request whose answer a gateway can store under its key."""
        return (
            isinstance(error, APIConnectionError)
            and error.code == "UNAVAILABLE"
            and self.request_id is not None
            and not self._multiple_choices
        )

    def _unseen(self, stored: pb.GenerateResponse) -> pb.GenerateResponse:
        """The stored answer less what the caller already got."""
        if stored.request_id != self.request_id or not stored.text.startswith(self._seen_text):
            raise APIResponseValidationError(
                "The stored answer does not continue what was streamed", request_id=self.request_id
            )
        rest = pb.GenerateResponse()
        rest.CopyFrom(stored)
        rest.text = stored.text[len(self._seen_text) :]
        del rest.token_ids[: self._seen_tokens]
        del rest.logprobs[: self._seen_tokens]
        return rest

    def _interrupted(self, cut: DiptychError, error: DiptychError) -> StreamInterruptedError:
        return StreamInterruptedError(
            f"The stream was cut after {self._seen_tokens} tokens ({cut.message}) and what request "
            f"{self.request_id} generated could not be fetched again ({error.code}: {error.message}); it was "
            "billed for what its gateway handed over. Send the request again under a new idempotency key",
            code="UNAVAILABLE",
            request_id=self.request_id,
            idempotency_key=self.idempotency_key,
        )


class _IdleWatchdog:
    """Cancels a sync call when the caller has waited `idle_timeout` seconds for its next message.

    Only time spent waiting counts: a caller that is slow to read buffered messages is no gateway silence.
    """

    def __init__(self, call: grpc.Call, idle_timeout: float | None) -> None:
        self.fired = False
        self._call = call
        self._idle_timeout = idle_timeout
        self._waiting_since: float | None = None
        self._stopped = False
        self._state = threading.Condition()
        if idle_timeout is not None:
            threading.Thread(target=self._watch, args=(idle_timeout,), name="diptych-stream-idle", daemon=True).start()

    def waiting(self) -> None:
        with self._state:
            self._waiting_since = time.monotonic()
            self._state.notify()

    def received(self) -> None:
        with self._state:
            self._waiting_since = None

    def stop(self) -> None:
        with self._state:
            self._stopped = True
            self._state.notify()

    def _watch(self, idle_timeout: float) -> None:
        with self._state:
            while not self._stopped:
                if self._waiting_since is None:
                    self._state.wait()
                    continue
                remaining = self._waiting_since + idle_timeout - time.monotonic()
                if remaining <= 0:
                    self.fired = True
                    break
                self._state.wait(remaining)
        if self.fired:
            self._call.cancel()


class Stream(_StreamState):
    """Completion chunks as the gateway produces them.

    Iterate it, ideally inside `with`. Leaving early (break, `close()`, the end of the
    `with` block) cancels the call so the gateway stops generating. Each chunk names its
    choice (`index`; n > 1); each choice's last chunk carries its `finish_reason`, and the
    stream's last chunk also the request's `usage`; `stream.usage` holds it too once read.
    """

    def __init__(
        self, call: SyncCall, *, idle_timeout: float | None, idempotency_key: str, reopen: SyncReopen | None = None
    ) -> None:
        super().__init__(idle_timeout, idempotency_key)
        self._call = call
        self._reopen = reopen
        self._watchdog = _IdleWatchdog(call, idle_timeout)
        self._chunks = self._iterate()

    def _wait_first_message(self) -> None:
        """Reads the first message now, so that a failure to start the call can still be retried."""
        self._first = self._read()
        self._initial_metadata = tuple(self._call.initial_metadata() or ())
        self.rate_limits = rate_limit_status(self._initial_metadata)

    def __next__(self) -> CompletionChunk:
        return next(self._chunks)

    def __iter__(self) -> Iterator[CompletionChunk]:
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
        self._watchdog.stop()
        self._call.cancel()

    def _read(self) -> pb.GenerateResponse | None:
        self._watchdog.waiting()
        try:
            message: pb.GenerateResponse = next(self._call)
        except StopIteration:
            return None
        except grpc.RpcError as rpc_error:
            if self._watchdog.fired:
                raise self._idle_error() from rpc_error
            if self._closed:
                return None
            raise self._rpc_error(rpc_error) from rpc_error
        finally:
            self._watchdog.received()
        return message

    def _iterate(self) -> Iterator[CompletionChunk]:
        try:
            message = self._first if self._first is not None else self._read()
            self._first = None
            while message is not None and not self._closed:
                chunk = self._chunk(message)
                yield chunk
                if chunk.usage is not None:  # the stream's last message (every choice has ended)
                    return
                message = self._next_or_resumed()
            if not self._closed:
                raise self._incomplete_error()
        finally:
            self._watchdog.stop()

    def _next_or_resumed(self) -> pb.GenerateResponse | None:
        try:
            return self._read()
        except DiptychError as cut:
            if self._reopen is None or not self._resumable(cut):
                raise
            return self._resume(cut)

    def _resume(self, cut: DiptychError) -> pb.GenerateResponse:
        assert self._reopen is not None and self.request_id is not None
        give_up_at = time.monotonic() + RESUME_TIMEOUT_S
        attempt = 0
        while True:
            call = self._reopen(self.request_id)
            try:
                return self._unseen(next(call))
            except grpc.RpcError as rpc_error:
                error = self._rpc_error(rpc_error)
            finally:
                call.cancel()
            delay = resume_delay(error, attempt)
            if delay is None or time.monotonic() + delay > give_up_at:
                raise self._interrupted(cut, error) from error
            time.sleep(delay)
            attempt += 1


class AsyncStream(_StreamState):
    """The asyncio twin of `Stream`: `async for` it, ideally inside `async with`."""

    def __init__(
        self,
        call: AsyncCall,
        *,
        idle_timeout: float | None,
        idempotency_key: str,
        reopen: AsyncReopen | None = None,
    ) -> None:
        super().__init__(idle_timeout, idempotency_key)
        self._call = call
        self._reopen = reopen
        self._chunks = self._iterate()

    async def _wait_first_message(self) -> None:
        self._first = await self._read()
        self._initial_metadata = tuple(await self._call.initial_metadata() or ())
        self.rate_limits = rate_limit_status(self._initial_metadata)

    async def __anext__(self) -> CompletionChunk:
        return await anext(self._chunks)

    async def __aiter__(self) -> AsyncIterator[CompletionChunk]:
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

    async def _read(self) -> pb.GenerateResponse | None:
        try:
            async with asyncio.timeout(self._idle_timeout):
                message = await self._call.read()
        except TimeoutError:
            self._call.cancel()
            raise self._idle_error() from None
        except grpc.RpcError as rpc_error:
            if self._closed:
                return None
            raise self._rpc_error(rpc_error) from rpc_error
        return message if isinstance(message, pb.GenerateResponse) else None  # else grpc.aio.EOF

    async def _iterate(self) -> AsyncIterator[CompletionChunk]:
        message = self._first if self._first is not None else await self._read()
        self._first = None
        while message is not None and not self._closed:
            chunk = self._chunk(message)
            yield chunk
            if chunk.usage is not None:  # the stream's last message (every choice has ended)
                return
            message = await self._next_or_resumed()
        if not self._closed:
            raise self._incomplete_error()

    async def _next_or_resumed(self) -> pb.GenerateResponse | None:
        try:
            return await self._read()
        except DiptychError as cut:
            if self._reopen is None or not self._resumable(cut):
                raise
            return await self._resume(cut)

    async def _resume(self, cut: DiptychError) -> pb.GenerateResponse:
        assert self._reopen is not None and self.request_id is not None
        give_up_at = time.monotonic() + RESUME_TIMEOUT_S
        attempt = 0
        while True:
            call = self._reopen(self.request_id)
            try:
                message = await call.read()
                if not isinstance(message, pb.GenerateResponse):  # grpc.aio.EOF
                    raise self._incomplete_error()
                return self._unseen(message)
            except grpc.RpcError as rpc_error:
                error = self._rpc_error(rpc_error)
            finally:
                call.cancel()
            delay = resume_delay(error, attempt)
            if delay is None or time.monotonic() + delay > give_up_at:
                raise self._interrupted(cut, error) from error
            await asyncio.sleep(delay)
            attempt += 1
