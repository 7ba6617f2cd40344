"""Running one Generate call, shared by completions and chat completions."""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

import grpc

from diptych_proto.v1 import inference_pb2 as pb

from .._convert import completion_from_chunks
from .._errors import error_from_rpc
from .._retry import with_retries, with_retries_async
from .._streaming import AsyncStream, Stream
from ..types import Completion

if TYPE_CHECKING:
    from .._client import AsyncClient, Client


def generate(
    client: Client, request: pb.GenerateRequest, *, stream: bool, timeout: float | None
) -> Completion | Stream:
    """Opens the call, retrying until its first message arrives, then streams or collects it."""
    deadline = client.timeout if timeout is None else timeout

    def attempt() -> Stream:
        try:
            call = client._transport.stub.Generate(request, timeout=deadline, metadata=client._metadata)
        except grpc.RpcError as rpc_error:
            raise error_from_rpc(rpc_error, idempotency_key=request.idempotency_key) from rpc_error
        chunks = Stream(call, idle_timeout=client.stream_idle_timeout, idempotency_key=request.idempotency_key)
        try:
            chunks._wait_first_message()
        except BaseException:
            chunks.close()
            raise
        return chunks

    chunks = with_retries(attempt, max_retries=client.max_retries)
    if stream:
        return chunks
    with chunks:
        completion = completion_from_chunks(list(chunks), model=request.model)
    return dataclasses.replace(completion, rate_limits=chunks.rate_limits)


async def generate_async(
    client: AsyncClient, request: pb.GenerateRequest, *, stream: bool, timeout: float | None
) -> Completion | AsyncStream:
    """The asyncio twin of `generate`."""
    deadline = client.timeout if timeout is None else timeout

    async def attempt() -> AsyncStream:
        call = client._transport.stub.Generate(request, timeout=deadline, metadata=client._metadata)
        chunks = AsyncStream(call, idle_timeout=client.stream_idle_timeout, idempotency_key=request.idempotency_key)
        try:
            await chunks._wait_first_message()
        except BaseException:
            await chunks.close()
            raise
        return chunks

    chunks = await with_retries_async(attempt, max_retries=client.max_retries)
    if stream:
        return chunks
    async with chunks:
        collected = [chunk async for chunk in chunks]
    return dataclasses.replace(completion_from_chunks(collected, model=request.model), rate_limits=chunks.rate_limits)
