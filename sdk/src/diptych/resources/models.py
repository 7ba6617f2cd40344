from __future__ import annotations

from functools import cached_property
from typing import Unpack

import grpc

from diptych_proto.v1 import inference_pb2 as pb

from .._convert import call_metadata, check_no_query, merge_extra_body, model_from_proto
from .._errors import error_from_rpc
from .._response import (
    async_to_raw_response_wrapper,
    async_to_streamed_grpc_response_wrapper,
    record_headers,
    to_raw_response_wrapper,
    to_streamed_grpc_response_wrapper,
)
from .._retry import with_retries, with_retries_async
from ..types import AsyncPage, Model, Page, RequestOptions
from ._connections import GatewayConnection
from ._keyword_parameters import KeywordParameters

__all__ = ["AsyncModels", "Models"]

_OPTIONS = KeywordParameters(RequestOptions)


class _Call:
    """One ListModels call's request, metadata and deadline, from the call's options."""

    def __init__(self, client: GatewayConnection, options: RequestOptions) -> None:
        check_no_query(options.get("extra_query"))
        self.request = pb.ListModelsRequest()
        extra_body = options.get("extra_body")
        if extra_body:
            merge_extra_body(self.request, extra_body)
        self.metadata = call_metadata(client._metadata, options.get("extra_headers"))
        timeout = options.get("timeout")
        self.deadline = client.timeout if timeout is None else timeout


def _page(response: pb.ListModelsResponse) -> Page[Model]:
    models = [model_from_proto(model) for model in response.models]
    return Page(data=models, has_more=False, total=len(models))


class Models:
    def __init__(self, client: GatewayConnection) -> None:
        self._client = client

    @cached_property
    def with_raw_response(self) -> ModelsWithRawResponse:
        return ModelsWithRawResponse(self)

    @cached_property
    def with_streaming_response(self) -> ModelsWithStreamingResponse:
        """`list` in a `with` block, answering an `APIResponse`: the gateway's gRPC metadata and `parse()`."""
        return ModelsWithStreamingResponse(self)

    @_OPTIONS.expand
    def list(self, **options: Unpack[RequestOptions]) -> Page[Model]:
        """The models the gateway serves, in one page (as every list: `.data`, iterable). `extra_headers` go as
        gRPC metadata; gRPC has no query string, and ListModelsRequest no fields, to put `extra_query` or
        `extra_body` in, so a non-empty one is refused with ValueError."""
        client = self._client
        call = _Call(client, _OPTIONS.complete(options))

        def attempt() -> pb.ListModelsResponse:
            response: pb.ListModelsResponse
            try:
                response, rpc = client._transport.stub.ListModels.with_call(
                    call.request, timeout=call.deadline, metadata=call.metadata
                )
            except grpc.RpcError as rpc_error:
                raise error_from_rpc(rpc_error) from rpc_error
            record_headers(rpc.initial_metadata())
            return response

        return _page(with_retries(attempt, max_retries=client.max_retries))


class AsyncModels:
    def __init__(self, client: GatewayConnection) -> None:
        self._client = client

    @cached_property
    def with_raw_response(self) -> AsyncModelsWithRawResponse:
        return AsyncModelsWithRawResponse(self)

    @cached_property
    def with_streaming_response(self) -> AsyncModelsWithStreamingResponse:
        return AsyncModelsWithStreamingResponse(self)

    @_OPTIONS.expand
    async def list(self, **options: Unpack[RequestOptions]) -> AsyncPage[Model]:
        """The models the gateway serves, in one page (`async for` walks it)."""
        client = self._client
        call = _Call(client, _OPTIONS.complete(options))

        async def attempt() -> pb.ListModelsResponse:
            rpc = client._transport.stub.ListModels(call.request, timeout=call.deadline, metadata=call.metadata)
            try:
                response: pb.ListModelsResponse = await rpc
                record_headers(await rpc.initial_metadata())
            except grpc.RpcError as rpc_error:
                raise error_from_rpc(rpc_error) from rpc_error
            return response

        page = _page(await with_retries_async(attempt, max_retries=client.max_retries))
        return AsyncPage(data=page.data, has_more=False, total=page.total)


class ModelsWithRawResponse:
    def __init__(self, models: Models) -> None:
        self.list = to_raw_response_wrapper(models.list)


class AsyncModelsWithRawResponse:
    def __init__(self, models: AsyncModels) -> None:
        self.list = async_to_raw_response_wrapper(models.list)


class ModelsWithStreamingResponse:
    def __init__(self, models: Models) -> None:
        self.list = to_streamed_grpc_response_wrapper(models.list)


class AsyncModelsWithStreamingResponse:
    def __init__(self, models: AsyncModels) -> None:
        self.list = async_to_streamed_grpc_response_wrapper(models.list)
