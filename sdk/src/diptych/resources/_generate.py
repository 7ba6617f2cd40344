"""Running one Generate call, shared by completions and chat completions."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

import grpc

from diptych_proto.v1 import inference_pb2 as pb

from .._convert import (
    call_metadata,
    check_no_query,
    check_stream_options,
    client_label,
    completion_from_chunks,
    generate_request,
    max_tokens_of,
    new_idempotency_key,
)
from .._errors import error_from_rpc
from .._response import record_headers
from .._retry import with_retries, with_retries_async
from .._streaming import AsyncStream, Stream
from ..types import Completion, CompletionChunk, GenerationParams
from ._connections import GatewayConnection

# not sampling fields, or not GenerateRequest's as they are named
_OF_THE_CALL = frozenset(
    {
        "model",
        "timeout",
        "idempotency_key",
        "extra_headers",
        "extra_query",
        "stream_options",
        "max_tokens",
        "max_completion_tokens",
        "user",
    }
)
_SHARED_FIELDS = tuple(name for name in GenerationParams.__annotations__ if name not in _OF_THE_CALL)


def create_request(
    arguments: GenerationParams, input_field: dict[str, Any], *, stream: bool, **own: Any
) -> pb.GenerateRequest:
    """The GenerateRequest of one `create` call: the fields both resources take, the input, and `own`, the
    fields of the resource alone."""
    check_no_query(arguments["extra_query"])
    check_stream_options(arguments["stream_options"], stream)
    key = arguments["idempotency_key"]
    shared: dict[str, Any] = {name: arguments[name] for name in _SHARED_FIELDS}  # type: ignore[literal-required]
    return generate_request(
        model=arguments["model"],
        input_field=input_field,
        idempotency_key=new_idempotency_key() if key is None else key,
        max_tokens=max_tokens_of(arguments["max_tokens"], arguments["max_completion_tokens"]),
        client_label=client_label(arguments["user"]),
        **shared,
        **own,
    )


def resumed(request: pb.GenerateRequest, request_id: str) -> pb.GenerateRequest:
    """The request asking for what execution `request_id` stored under the request's idempotency key."""
    replay = pb.GenerateRequest()
    replay.CopyFrom(request)
    replay.resume_request_id = request_id
    return replay


def generate(
    client: GatewayConnection,
    request: pb.GenerateRequest,
    *,
    stream: bool,
    timeout: float | None,
    extra_headers: Mapping[str, str] | None = None,
) -> Completion | Stream:
    """Opens the call, retrying until its first message arrives, then streams or collects it."""
    deadline = client.timeout if timeout is None else timeout
    metadata = call_metadata(client._metadata, extra_headers)

    def attempt() -> Stream:
        try:
            call = client._transport.stub.Generate(request, timeout=deadline, metadata=metadata)
        except grpc.RpcError as rpc_error:
            raise error_from_rpc(rpc_error, idempotency_key=request.idempotency_key) from rpc_error
        chunks = Stream(
            call,
            idle_timeout=client.stream_idle_timeout,
            idempotency_key=request.idempotency_key,
            reopen=lambda request_id: client._transport.stub.Generate(
                resumed(request, request_id), timeout=deadline, metadata=metadata
            ),
        )
        try:
            chunks._wait_first_message()
        except BaseException:
            chunks.close()
            raise
        return chunks

    chunks = with_retries(attempt, max_retries=client.max_retries)
    record_headers(chunks._initial_metadata)
    if stream:
        return chunks
    with chunks:
        collected = list(chunks)
    return _completion(request, collected, chunks)


async def generate_async(
    client: GatewayConnection,
    request: pb.GenerateRequest,
    *,
    stream: bool,
    timeout: float | None,
    extra_headers: Mapping[str, str] | None = None,
) -> Completion | AsyncStream:
    """The asyncio twin of `generate`."""
    deadline = client.timeout if timeout is None else timeout
    metadata = call_metadata(client._metadata, extra_headers)

    async def attempt() -> AsyncStream:
        call = client._transport.stub.Generate(request, timeout=deadline, metadata=metadata)
        chunks = AsyncStream(
            call,
            idle_timeout=client.stream_idle_timeout,
            idempotency_key=request.idempotency_key,
            reopen=lambda request_id: client._transport.stub.Generate(
                resumed(request, request_id), timeout=deadline, metadata=metadata
            ),
        )
        try:
            await chunks._wait_first_message()
        except BaseException:
            await chunks.close()
            raise
        return chunks

    chunks = await with_retries_async(attempt, max_retries=client.max_retries)
    record_headers(chunks._initial_metadata)
    if stream:
        return chunks
    async with chunks:
        collected = [chunk async for chunk in chunks]
    return _completion(request, collected, chunks)


def _completion(
    request: pb.GenerateRequest, chunks: Sequence[CompletionChunk], stream: Stream | AsyncStream
) -> Completion:
    completion = completion_from_chunks(chunks, model=request.model, chat=request.WhichOneof("input") == "chat")
    return dataclasses.replace(completion, rate_limits=stream.rate_limits)
