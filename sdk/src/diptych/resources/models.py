from __future__ import annotations

from functools import cached_property

import grpc

from diptych_proto.v1 import inference_pb2 as pb

from .._convert import model_from_proto
from .._errors import error_from_rpc
from .._response import async_to_raw_response_wrapper, record_headers, to_raw_response_wrapper
from .._retry import with_retries, with_retries_async
from ..types import Model
from ._connections import GatewayConnection

__all__ = ["Models", "AsyncModels"]


class Models:
    def __init__(self, client: GatewayConnection) -> None:
        self._client = client

    @cached_property
    def with_raw_response(self) -> ModelsWithRawResponse:
        return ModelsWithRawResponse(self)

    def list(self, *, timeout: float | None = None) -> list[Model]:
        """The models the gateway serves."""
        client = self._client

        def attempt() -> pb.ListModelsResponse:
            deadline = client.timeout if timeout is None else timeout
            response: pb.ListModelsResponse
            try:
                response, call = client._transport.stub.ListModels.with_call(
                    pb.ListModelsRequest(), timeout=deadline, metadata=client._metadata
                )
            except grpc.RpcError as rpc_error:
                raise error_from_rpc(rpc_error) from rpc_error
            record_headers(call.initial_metadata())
            return response

        response = with_retries(attempt, max_retries=client.max_retries)
        return [model_from_proto(model) for model in response.models]


class AsyncModels:
    def __init__(self, client: GatewayConnection) -> None:
        self._client = client

    @cached_property
    def with_raw_response(self) -> AsyncModelsWithRawResponse:
        return AsyncModelsWithRawResponse(self)

    async def list(self, *, timeout: float | None = None) -> list[Model]:
        """The models the gateway serves."""
        client = self._client

        async def attempt() -> pb.ListModelsResponse:
            deadline = client.timeout if timeout is None else timeout
            call = client._transport.stub.ListModels(
                pb.ListModelsRequest(), timeout=deadline, metadata=client._metadata
            )
            try:
                response: pb.ListModelsResponse = await call
                record_headers(await call.initial_metadata())
            except grpc.RpcError as rpc_error:
                raise error_from_rpc(rpc_error) from rpc_error
            return response

        response = await with_retries_async(attempt, max_retries=client.max_retries)
        return [model_from_proto(model) for model in response.models]


class ModelsWithRawResponse:
    def __init__(self, models: Models) -> None:
        self.list = to_raw_response_wrapper(models.list)


class AsyncModelsWithRawResponse:
    def __init__(self, models: AsyncModels) -> None:
        self.list = async_to_raw_response_wrapper(models.list)
