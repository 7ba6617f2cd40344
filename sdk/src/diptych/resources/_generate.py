"""Running one Generate call, shared by completions and chat completions."""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import TYPE_CHECKING

import grpc
import grpc.aio

from .._convert import chunk_from_proto, completion_from_chunks
from .._proto.v1 import inference_pb2 as pb
from .._retry import with_retries, with_retries_async
from .._streaming import AsyncStream, Stream
from ..types import Completion, CompletionChunk

if TYPE_CHECKING:
    from .._client import AsyncClient, Client


def generate(
    client: Client, request: pb.GenerateRequest, *, stream: bool, timeout: float | None
) -> Completion | Stream[CompletionChunk]:
    """Opens the call, retrying until its first message arrives, then streams or collects it."""
    deadline = client.timeout if timeout is None else timeout

    def attempt() -> tuple[grpc.Call, pb.GenerateResponse | None]:
        call = client._transport.stub.Generate(request, timeout=deadline, metadata=client._metadata)
        try:
            return call, next(call)
        except StopIteration:
            return call, None
        except BaseException:
            call.cancel()
            raise

    call, first_message = with_retries(attempt, max_retries=client.max_retries, request_id=request.request_id)
    chunks = Stream(call, first_message, parse=_chunk_parser(request), request_id=request.request_id)
    if stream:
        return chunks
    with chunks:
        return completion_from_chunks(list(chunks), model=request.model, request_id=request.request_id)


async def generate_async(
    client: AsyncClient, request: pb.GenerateRequest, *, stream: bool, timeout: float | None
) -> Completion | AsyncStream[CompletionChunk]:
    """The asyncio twin of `generate`."""
    deadline = client.timeout if timeout is None else timeout

    async def attempt() -> tuple[grpc.aio.UnaryStreamCall, pb.GenerateResponse | None]:
        call = client._transport.stub.Generate(request, timeout=deadline, metadata=client._metadata)
        try:
            message = await call.read()
        except BaseException:
            call.cancel()
            raise
        return call, None if message is grpc.aio.EOF else message

    call, first_message = await with_retries_async(
        attempt, max_retries=client.max_retries, request_id=request.request_id
    )
    chunks = AsyncStream(call, first_message, parse=_chunk_parser(request), request_id=request.request_id)
    if stream:
        return chunks
    async with chunks:
        collected = [chunk async for chunk in chunks]
    return completion_from_chunks(collected, model=request.model, request_id=request.request_id)


def _chunk_parser(request: pb.GenerateRequest) -> Callable[[pb.GenerateResponse], CompletionChunk]:
    return partial(chunk_from_proto, request_id=request.request_id)
