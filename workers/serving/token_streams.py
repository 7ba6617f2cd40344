"""Token streams: one gRPC stream per caller (a gateway) that carries the tokens of all its Decode and
Generate calls on this worker, a message per engine step (`StreamTokens`, worker.proto).

A call's own stream costs a message per token: at 32 streams that is 32 gRPC writes on the worker and 32
reads on the gateway per step, and gRPC's per-message work was most of both processes' CPU per token.
The calls that name a token stream put their tokens here instead; every call's consumer runs in the same
turn of the event loop after the engine's step, so the stream's task wakes once and sends them together.
"""

import asyncio
from collections.abc import AsyncIterator

from diptych_common.proto.v1 import worker_pb2


class TokenStreamClosed(Exception):
    """The caller's token stream ended: nothing can reach it any more."""


class TokenStream:
    def __init__(self) -> None:
        self._pending: list[worker_pb2.StreamedToken] = []
        self._ready = asyncio.Event()
        self.closed = False
        self.tokens_put = 0

    def put(self, request_id: str, event: worker_pb2.TokenEvent) -> None:
        if self.closed:
            raise TokenStreamClosed
        self._pending.append(worker_pb2.StreamedToken(request_id=request_id, event=event))
        self.tokens_put += 1
        self._ready.set()

    async def batches(self) -> AsyncIterator[worker_pb2.TokenBatch]:
        """An empty batch at once (the stream is open), then what was put since the last batch, whenever
        something was."""
        yield worker_pb2.TokenBatch()
        while True:
            await self._ready.wait()
            self._ready.clear()
            tokens, self._pending = self._pending, []
            yield worker_pb2.TokenBatch(tokens=tokens)


class TokenStreams:
    """This worker's open token streams, by the id their caller chose."""

    def __init__(self) -> None:
        self._open: dict[str, TokenStream] = {}
        self.tokens_of_closed = 0

    @property
    def tokens_streamed(self) -> int:
        """Tokens put on this worker's token streams, since it started."""
        return self.tokens_of_closed + sum(stream.tokens_put for stream in self._open.values())

    def open(self, stream_id: str) -> TokenStream | None:
        """A new stream under `stream_id`; None when one is open under it already."""
        if stream_id in self._open:
            return None
        stream = self._open[stream_id] = TokenStream()
        return stream

    def close(self, stream_id: str, stream: TokenStream) -> None:
        stream.closed = True
        if self._open.get(stream_id) is stream:
            del self._open[stream_id]
            self.tokens_of_closed += stream.tokens_put

    def get(self, stream_id: str) -> TokenStream | None:
        return self._open.get(stream_id)
