"""The gateway's gRPC channels to its workers, one per address, shared by load watching and requests, and
each worker's token stream for this gateway's calls."""

import asyncio

import grpc
from opentelemetry.trace import Span

from diptych_common.proto.v1 import worker_pb2_grpc
from diptych_common.tracing import grpc_metadata
from diptych_common.worker_credential import WorkerSecret
from gateway.fleet.token_streams import WorkerTokenStream

# A worker that died is often replaced at the same address within seconds (a restarted pod or process):
# gRPC's default reconnect backoff grows to two minutes, which would hide the new worker that long.
RECONNECT_OPTIONS = (
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.min_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 1000),
)


class Channels:
    """One gRPC channel per worker address, shared by load watching and requests. Every call on them
    passes `metadata()`, which carries the worker RPC secret (a worker refuses a call without it). The
    secret goes in by hand, not by a client interceptor: an intercepted stream routes every message it
    reads through the interceptor's task, a cost per token."""

    def __init__(self, secret: WorkerSecret | None = None) -> None:
        self._channels: dict[str, grpc.aio.Channel] = {}
        self.secret = secret or WorkerSecret()  # set once the control plane handed it over
        self._token_streams: dict[str, asyncio.Task[WorkerTokenStream | None]] = {}

    def stub(self, address: str) -> worker_pb2_grpc.WorkerStub:
        channel = self._channels.get(address)
        if channel is None:
            channel = self._channels[address] = grpc.aio.insecure_channel(address, options=RECONNECT_OPTIONS)
        return worker_pb2_grpc.WorkerStub(channel)

    def metadata(self, span: Span | None = None) -> tuple[tuple[str, str], ...]:
        """A worker call's metadata: the secret (read now: it may arrive after the channel was made) and
        `span`'s trace context."""
        return self.secret.metadata() + (grpc_metadata(span) if span is not None else ())

    async def token_stream(self, address: str, timeout_s: float) -> WorkerTokenStream | None:
        """The worker's token stream for this gateway's calls, opened once (again after it ended); None
        when the worker serves none. Raises as `WorkerTokenStream.open` does."""
        opening = self._token_streams.get(address)
        if opening is None or _ended(opening):
            opening = asyncio.create_task(WorkerTokenStream.open(self.stub(address), self.metadata(), timeout_s))
            self._token_streams[address] = opening
        try:
            return await asyncio.shield(opening)
        except BaseException:
            if opening.done() and self._token_streams.get(address) is opening:
                del self._token_streams[address]  # a failed opening is tried afresh by the next call
            raise

    async def close(self) -> None:
        for opening in self._token_streams.values():
            if opening.done() and not opening.cancelled() and opening.exception() is None:
                stream = opening.result()
                if stream is not None:
                    stream.close()
            else:
                opening.cancel()
        self._token_streams.clear()
        for channel in self._channels.values():
            await channel.close()
        self._channels.clear()


def _ended(opening: "asyncio.Task[WorkerTokenStream | None]") -> bool:
    """Whether an opened token stream ended (a worker's restart, a broken connection): open it again."""
    if not opening.done() or opening.cancelled() or opening.exception() is not None:
        return opening.done()
    stream = opening.result()
    return stream is not None and stream.ended
