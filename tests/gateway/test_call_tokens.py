"""A call's tokens as the gateway reads them from a worker's token stream (`CallTokens`): what arrived
together is read together, in order; the next-token deadline holds without a timer per token; a failure
(the call's, the stream's, a lost KV hand-off) comes after the tokens that came before it, and nothing
after it. The worker's side is scripted here as the messages its calls would read; the gateway's reading
of a real worker's stream is tests/workers/test_token_streams.py's."""

import asyncio
import time

import grpc
import pytest

from diptych_common.proto.v1 import worker_pb2
from gateway.fleet.token_streams import CallTokens, WorkerTokenStream


class ScriptedCall:
    """A gRPC call's reading end: `read()` returns what was given to `send`, in order (raising the errors
    among it), and waits while nothing is there; `cancel()` ends it."""

    def __init__(self) -> None:
        self._items: asyncio.Queue[object] = asyncio.Queue()
        self.cancelled = False

    def send(self, item: object) -> None:
        self._items.put_nowait(item)

    async def read(self):
        item = await self._items.get()
        if isinstance(item, BaseException):
            raise item
        return item

    def cancel(self) -> None:
        self.cancelled = True
        self._items.put_nowait(grpc.aio.EOF)


def batch(*tokens: tuple[str, int], finished: bool = False) -> worker_pb2.TokenBatch:
    return worker_pb2.TokenBatch(
        tokens=[
            worker_pb2.StreamedToken(
                request_id=request_id, event=worker_pb2.TokenEvent(token_id=token, finished=finished)
            )
            for request_id, token in tokens
        ]
    )


def rpc_error(code: grpc.StatusCode) -> grpc.aio.AioRpcError:
    return grpc.aio.AioRpcError(code, grpc.aio.Metadata(), grpc.aio.Metadata(), details="scripted")


async def settle() -> None:
    """Lets the stream's reader task hand over what was sent."""
    for _ in range(5):
        await asyncio.sleep(0)


@pytest.fixture
async def stream():
    worker_stream = ScriptedCall()
    opened = WorkerTokenStream(worker_stream, "stream-1")
    yield worker_stream, opened
    opened.close()


async def test_tokens_that_arrived_together_are_read_together_and_in_order(stream):
    worker_stream, opened = stream
    tokens = CallTokens(ScriptedCall(), opened, "r1")
    other = CallTokens(ScriptedCall(), opened, "r2")
    worker_stream.send(batch(("r1", 5), ("r2", 50), ("r1", 6)))
    worker_stream.send(batch(("r1", 7)))
    await settle()
    assert [event.token_id for event in await tokens.read_ready(1)] == [5, 6, 7]
    assert [event.token_id for event in await other.read_ready(1)] == [50]
    worker_stream.send(batch(("r1", 8)))
    assert [event.token_id for event in await tokens.read_ready(1)] == [8]  # waited for it
    tokens.close()
    other.close()


async def test_a_read_with_no_token_in_time_times_out_at_its_deadline(stream):
    _, opened = stream
    tokens = CallTokens(ScriptedCall(), opened, "r1")
    started = time.monotonic()
    with pytest.raises(TimeoutError):
        await tokens.read_ready(0.2)
    assert 0.19 <= time.monotonic() - started < 2
    tokens.close()


async def test_tokens_that_keep_coming_within_the_deadline_never_time_out(stream):
    """One timer serves every read: it is moved on when it fires, so reads that each got their token in
    time pass, however long the stream lasts in all."""
    worker_stream, opened = stream
    tokens = CallTokens(ScriptedCall(), opened, "r1")
    received = []
    started = time.monotonic()
    while time.monotonic() - started < 2.0:  # four times the deadline
        asyncio.get_running_loop().call_later(0.05, worker_stream.send, batch(("r1", len(received))))
        received += [event.token_id for event in await tokens.read_ready(0.5)]
    assert received == list(range(len(received))) and len(received) >= 4
    with pytest.raises(TimeoutError):  # and the deadline still holds once they stop
        await tokens.read_ready(0.5)
    tokens.close()


async def test_a_shorter_deadline_after_a_longer_one_holds(stream):
    """The first token may take long (its prompt runs), each next one not: the next read's deadline comes
    before the first's timer would fire."""
    worker_stream, opened = stream
    tokens = CallTokens(ScriptedCall(), opened, "r1")
    asyncio.get_running_loop().call_later(0.05, worker_stream.send, batch(("r1", 1)))
    assert [event.token_id for event in await tokens.read_ready(30)] == [1]
    started = time.monotonic()
    with pytest.raises(TimeoutError):
        await tokens.read_ready(0.2)
    assert time.monotonic() - started < 2
    tokens.close()


async def test_a_failure_comes_after_the_tokens_before_it_and_nothing_after_it(stream):
    worker_stream, opened = stream
    tokens = CallTokens(ScriptedCall(), opened, "r1")
    worker_stream.send(batch(("r1", 1), ("r1", 2)))
    await settle()
    lost = RuntimeError("the KV hand-off failed")
    tokens.fail(lost)
    worker_stream.send(batch(("r1", 3)))
    await settle()
    assert [event.token_id for event in await tokens.read_ready(1)] == [1, 2]
    with pytest.raises(RuntimeError) as raised:
        await tokens.read_ready(1)
    assert raised.value is lost
    tokens.close()


async def test_a_failure_wakes_a_reader_waiting_for_a_token(stream):
    _, opened = stream
    tokens = CallTokens(ScriptedCall(), opened, "r1")
    reading = asyncio.create_task(tokens.read_ready(30))
    await settle()
    tokens.fail(RuntimeError("the KV hand-off failed"))
    with pytest.raises(RuntimeError, match="hand-off"):
        await asyncio.wait_for(reading, 1)
    tokens.close()


async def test_the_calls_own_failure_reaches_its_reader_after_its_tokens(stream):
    worker_stream, opened = stream
    call = ScriptedCall()
    tokens = CallTokens(call, opened, "r1")
    worker_stream.send(batch(("r1", 1)))
    await settle()
    call.send(rpc_error(grpc.StatusCode.INTERNAL))
    await settle()
    assert [event.token_id for event in await tokens.read_ready(1)] == [1]
    with pytest.raises(grpc.aio.AioRpcError) as raised:
        await tokens.read_ready(1)
    assert raised.value.code() is grpc.StatusCode.INTERNAL
    tokens.close()
    assert call.cancelled


async def test_a_stream_that_ends_ends_every_call_on_it_after_their_tokens(stream):
    worker_stream, opened = stream
    first, second = CallTokens(ScriptedCall(), opened, "r1"), CallTokens(ScriptedCall(), opened, "r2")
    worker_stream.send(batch(("r1", 1)))
    worker_stream.send(rpc_error(grpc.StatusCode.UNAVAILABLE))
    await settle()
    assert [event.token_id for event in await first.read_ready(1)] == [1]
    for tokens in (first, second):
        with pytest.raises(grpc.aio.AioRpcError):
            await tokens.read_ready(1)
    late = CallTokens(ScriptedCall(), opened, "r3")  # a call that names the stream after it ended
    with pytest.raises(grpc.aio.AioRpcError):
        await late.read_ready(1)
    for tokens in (first, second, late):
        tokens.close()


async def test_a_call_that_carries_its_own_tokens_is_read_the_same_way():
    """A worker without token streams: the call's own stream carries one event a message."""
    call = ScriptedCall()
    tokens = CallTokens(call, None, "r1")
    for token in (1, 2):
        call.send(worker_pb2.TokenEvent(token_id=token))
    await settle()
    assert [event.token_id for event in await tokens.read_ready(1)] == [1, 2]
    call.send(worker_pb2.TokenEvent(token_id=3, finished=True))
    assert [event.token_id for event in await tokens.read_ready(1)] == [3]
    call.send(grpc.aio.EOF)
    assert await tokens.read_ready(1) is grpc.aio.EOF
    reading = asyncio.create_task(CallTokens(ScriptedCall(), None, "r2").read_ready(0.1))
    with pytest.raises(TimeoutError):
        await reading
    tokens.close()


async def test_read_gives_one_event_at_a_time(stream):
    worker_stream, opened = stream
    tokens = CallTokens(ScriptedCall(), opened, "r1")
    worker_stream.send(batch(("r1", 1), ("r1", 2)))
    assert [(await tokens.read(1)).token_id, (await tokens.read(1)).token_id] == [1, 2]
    worker_stream.send(batch(("r1", 3), finished=True))
    assert (await tokens.read()).finished
    tokens.close()
