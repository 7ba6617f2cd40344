"""The gateway's end of the workers' token streams (`StreamTokens`, worker.proto): one stream per decode or
colocated worker carries the tokens of every call this gateway runs there, a message per engine step,
where each call's own stream would carry a message per token (gRPC's per-message work was most of the
gateway's CPU per token).

A call's tokens are read through `CallTokens`, with the semantics of reading the call's own stream: a
token event, `grpc.aio.EOF` when the stream that carries them ended, or the call's or the token stream's
`AioRpcError`. Workers that do not serve `StreamTokens` get calls that carry their own tokens.
"""

import asyncio
import logging
import secrets

import grpc

from diptych_common.proto.v1 import worker_pb2, worker_pb2_grpc

log = logging.getLogger(__name__)


class WorkerTokenStream:
    """One open `StreamTokens` call: it hands each token to the queue of the call it belongs to."""

    def __init__(self, call, stream_id: str) -> None:
        self.stream_id = stream_id
        self._call = call
        self._queues: dict[str, asyncio.Queue[object]] = {}
        self.ended = False
        self._reader = asyncio.create_task(self._read_forever())

    @classmethod
    async def open(cls, stub: worker_pb2_grpc.WorkerStub, metadata, timeout_s: float) -> "WorkerTokenStream | None":
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

    def subscribe(self, request_id: str) -> "asyncio.Queue[object]":
        queue: asyncio.Queue[object] = asyncio.Queue()
        self._queues[request_id] = queue
        return queue

    def unsubscribe(self, request_id: str) -> None:
        self._queues.pop(request_id, None)

    def close(self) -> None:
        self._call.cancel()
        self._reader.cancel()

    async def _read_forever(self) -> None:
        ended: object = grpc.aio.EOF
        try:
            while (batch := await self._call.read()) is not grpc.aio.EOF:  # read(), as `open` began: never mixed
                for token in batch.tokens:
                    queue = self._queues.get(token.request_id)
                    if queue is not None:  # else a call that was cancelled, or failed over
                        queue.put_nowait(token.event)
        except grpc.aio.AioRpcError as error:
            ended = error
        finally:
            self.ended = True
            for queue in self._queues.values():
                queue.put_nowait(ended)


class CallTokens:
    """The token events of one Decode or Generate call, read as from the call's own stream."""

    def __init__(self, call, stream: WorkerTokenStream | None, request_id: str) -> None:
        self._call = call
        self._stream = stream
        self._request_id = request_id
        self._queue = stream.subscribe(request_id) if stream is not None else None
        self._watcher = asyncio.create_task(self._watch_call()) if self._queue is not None else None

    async def read(self):
        if self._queue is None:
            return await self._call.read()
        item = await self._queue.get()
        if isinstance(item, grpc.aio.AioRpcError):
            raise item
        return item

    def close(self) -> None:
        self._call.cancel()
        if self._stream is not None:
            self._stream.unsubscribe(self._request_id)
        if self._watcher is not None:
            self._watcher.cancel()

    async def _watch_call(self) -> None:
        """The call's own stream carries no tokens: only its failure (the request's own, or the worker's)
        is news, and goes to the reader in order with the tokens."""
        assert self._queue is not None
        try:
            while await self._call.read() is not grpc.aio.EOF:
                pass
        except grpc.aio.AioRpcError as error:
            if error.code() is not grpc.StatusCode.CANCELLED:
                self._queue.put_nowait(error)
