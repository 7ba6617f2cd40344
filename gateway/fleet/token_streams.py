"""The gateway's end of the workers' token streams (`StreamTokens`, worker.proto): one stream per decode or
colocated worker carries the tokens of every call this gateway runs there, a message per engine step,
where each call's own stream would carry a message per token (gRPC's per-message work was most of the
gateway's CPU per token).

A call's tokens are read through `CallTokens`, with the semantics of reading the call's own stream: token
events, `grpc.aio.EOF` when the stream that carries them ended, or the call's or the token stream's
`AioRpcError`. `read_ready` hands over every event that arrived since the last read in one list, so that
tokens that came together (a speculative step's, or a step's that came while the request's previous
token was still being written to its client) go on together. Workers that do not serve `StreamTokens`
get calls that carry their own tokens.
"""

import asyncio
import logging
import secrets
from typing import Any

import grpc

from diptych_common.proto.v1 import worker_pb2, worker_pb2_grpc
from gateway.metrics import WORKER_BYTES_RECEIVED

log = logging.getLogger(__name__)


class WorkerTokenStream:
    """One open `StreamTokens` call: it hands each token to the call it belongs to."""

    def __init__(
        self, call: grpc.aio.UnaryStreamCall[worker_pb2.TokenStreamRequest, worker_pb2.TokenBatch], stream_id: str
    ) -> None:
        self.stream_id = stream_id
        self._call = call
        self._calls: dict[str, CallTokens] = {}
        self.ended = False
        self._ended_with: object = grpc.aio.EOF
        self._reader = asyncio.create_task(self._read_forever())

    @classmethod
    async def open(
        cls, stub: worker_pb2_grpc.WorkerStub, metadata: tuple[tuple[str, str], ...], timeout_s: float
    ) -> "WorkerTokenStream | None":
        """A stream open on the worker (it answered its first, empty batch); None when the worker does not
        serve token streams. Raises the call's AioRpcError, or TimeoutError, when it could not be opened."""
        stream_id = secrets.token_hex(16)
        call = stub.StreamTokens(worker_pb2.TokenStreamRequest(stream_id=stream_id), metadata=metadata)
        try:
            async with asyncio.timeout(timeout_s):
                first = await call.read()
        except grpc.aio.AioRpcError as error:
            if error.code() is grpc.StatusCode.UNIMPLEMENTED:
                return None
            raise
        except BaseException:
            call.cancel()
            raise
        if first is grpc.aio.EOF:
            raise ConnectionError("the worker ended its token stream as it opened")
        return cls(call, stream_id)

    def subscribe(self, request_id: str, tokens: "CallTokens") -> None:
        if self.ended:
            tokens.end(self._ended_with)
        self._calls[request_id] = tokens

    def unsubscribe(self, request_id: str) -> None:
        self._calls.pop(request_id, None)

    def close(self) -> None:
        self._call.cancel()
        self._reader.cancel()

    async def _read_forever(self) -> None:
        ended: object = grpc.aio.EOF
        calls = self._calls
        try:
            # read(), as `open` began: never mixed; what is not a batch is grpc.aio.EOF
            while isinstance(batch := await self._call.read(), worker_pb2.TokenBatch):
                WORKER_BYTES_RECEIVED.inc(batch.ByteSize())
                for token in batch.tokens:
                    tokens = calls.get(token.request_id)
                    if tokens is not None:  # else a call that was cancelled, or failed over
                        tokens.put(token.event)
        except grpc.aio.AioRpcError as error:
            ended = error
        finally:
            self.ended, self._ended_with = True, ended
            for tokens in calls.values():
                tokens.end(ended)


class CallTokens:
    """The token events of one Decode or Generate call, read as from the call's own stream.

    They wait in a list of their own until read, with one future for the reader to wait on. The reader's
    deadline is a time it sets, checked by one timer that is moved on only when it fires, so that a token
    costs no timer of its own (an `asyncio.timeout` per token cost more than the rest of the read)."""

    def __init__(
        self,
        call: grpc.aio.UnaryStreamCall[Any, worker_pb2.TokenEvent],  # a Decode or a Generate call: either request
        stream: WorkerTokenStream | None,
        request_id: str,
    ) -> None:
        self._call = call
        self._stream = stream
        self._request_id = request_id
        self._loop = asyncio.get_running_loop()
        self._ready: list[worker_pb2.TokenEvent] = []
        self._end: object = None  # EOF, or the error met once the events before it are read
        self._waiter: asyncio.Future[None] | None = None
        self._deadline = 0.0
        self._timer: asyncio.TimerHandle | None = None
        self._timer_at = 0.0
        if stream is not None:
            stream.subscribe(request_id, self)
            self._reader = asyncio.create_task(self._watch_call())
        else:
            self._reader = asyncio.create_task(self._read_own_stream())

    async def read_ready(self, timeout_s: float | None = None) -> list[worker_pb2.TokenEvent] | object:
        """Every event that arrived and was not read yet, waiting up to `timeout_s` (None: no limit) for
        the first; or `grpc.aio.EOF`. Raises the call's or the stream's AioRpcError (after the events that
        came before it), `fail`'s error, or TimeoutError."""
        if not self._ready and self._end is None:
            await self._wait(timeout_s)
        if self._ready:
            ready, self._ready = self._ready, []
            return ready
        if isinstance(self._end, BaseException):
            raise self._end
        return self._end

    async def read(self, timeout_s: float | None = None) -> worker_pb2.TokenEvent | object:
        """The next event alone, or `grpc.aio.EOF`; raises as `read_ready` does."""
        if not self._ready:
            ready = await self.read_ready(timeout_s)
            if not isinstance(ready, list):  # grpc.aio.EOF: read_ready raises the errors
                return ready
            self._ready = ready
        return self._ready.pop(0)

    def put(self, event: worker_pb2.TokenEvent) -> None:
        """An event of this call; none is taken after the call's end."""
        if self._end is None:
            self._ready.append(event)
            self._wake()

    def end(self, item: object) -> None:
        """What the reader meets once the events that came before it are read: EOF or an error."""
        if self._end is None:
            self._end = item
            self._wake()

    def fail(self, error: BaseException) -> None:
        """Fails the reader with `error`, after the events already here, as a failure of the call would."""
        self.end(error)

    def close(self) -> None:
        self._call.cancel()
        if self._stream is not None:
            self._stream.unsubscribe(self._request_id)
        self._reader.cancel()
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    async def _wait(self, timeout_s: float | None) -> None:
        if timeout_s is not None:
            self._deadline = deadline = self._loop.time() + timeout_s
            if self._timer is None or self._timer_at > deadline:
                if self._timer is not None:
                    self._timer.cancel()
                self._arm(deadline)
        else:
            self._deadline = float("inf")
        self._waiter = self._loop.create_future()
        try:
            await self._waiter
        finally:
            self._waiter = None

    def _arm(self, at: float) -> None:
        self._timer_at = at
        self._timer = self._loop.call_at(at, self._on_timer)

    def _on_timer(self) -> None:
        self._timer = None
        waiter = self._waiter
        if waiter is None or waiter.done() or self._deadline == float("inf"):
            return  # nobody waits with a deadline: the next wait arms it again
        if self._loop.time() >= self._deadline:
            waiter.set_exception(TimeoutError())
        else:
            self._arm(self._deadline)

    def _wake(self) -> None:
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    async def _watch_call(self) -> None:
        """The call's own stream carries no tokens: only its failure (the request's own, or the worker's)
        is news, and goes to the reader in order with the tokens."""
        try:
            while await self._call.read() is not grpc.aio.EOF:
                pass
        except grpc.aio.AioRpcError as error:
            if error.code() is not grpc.StatusCode.CANCELLED:
                self.end(error)

    async def _read_own_stream(self) -> None:
        """A worker without token streams: the call's own stream carries its tokens, one a message."""
        try:
            while isinstance(event := await self._call.read(), worker_pb2.TokenEvent):  # else grpc.aio.EOF
                WORKER_BYTES_RECEIVED.inc(event.ByteSize())
                self.put(event)
            self.end(grpc.aio.EOF)
        except grpc.aio.AioRpcError as error:
            self.end(error)
