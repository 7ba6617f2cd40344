"""A gRPC server that only the gateway and other workers may call, for a worker and the KV tier alike:
every call but the standard health service must carry the worker RPC secret (see diptych_common.worker_credential)."""

from __future__ import annotations  # grpc.RpcMethodHandler is generic in grpc's stubs only

from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, TypeVar

import grpc

from diptych_common.worker_credential import WorkerSecret

OPEN_SERVICES = ("/grpc.health.v1.Health/",)  # probes (kubelet, the supervisor) hold no secret

# The interceptor's method is generic over the call's request and response messages, as grpc's own is.
_Request = TypeVar("_Request")
_Response = TypeVar("_Response")


class RequireWorkerSecret(grpc.aio.ServerInterceptor):
    def __init__(self, secret: WorkerSecret) -> None:
        self._secret = secret

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler[_Request, _Response] | None]],
        details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler[_Request, _Response] | None:
        handler = await continuation(details)
        if handler is None or details.method.startswith(OPEN_SERVICES):
            return handler
        reason = self._secret.refusal(details.invocation_metadata)
        return handler if reason is None else _refusing(handler, reason)


def worker_server(secret: WorkerSecret, options: list[tuple[str, Any]] | None = None) -> grpc.aio.Server:
    """A gRPC server that refuses every call without the secret."""
    return grpc.aio.server(interceptors=[RequireWorkerSecret(secret)], options=options)


def _refusing(
    handler: grpc.RpcMethodHandler[_Request, _Response], reason: str
) -> grpc.RpcMethodHandler[_Request, _Response]:
    """A handler of the same kind as `handler` that answers UNAUTHENTICATED without running it."""

    async def refuse(_request: object, context: grpc.aio.ServicerContext[_Request, _Response]) -> None:
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, reason)

    async def refuse_stream(
        _request: object, context: grpc.aio.ServicerContext[_Request, _Response]
    ) -> AsyncIterator[None]:
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, reason)
        yield  # an async generator, as a streaming response needs

    deserializer, serializer = handler.request_deserializer, handler.response_serializer
    if handler.request_streaming and handler.response_streaming:
        return grpc.stream_stream_rpc_method_handler(refuse_stream, deserializer, serializer)
    if handler.request_streaming:
        return grpc.stream_unary_rpc_method_handler(refuse, deserializer, serializer)
    if handler.response_streaming:
        return grpc.unary_stream_rpc_method_handler(refuse_stream, deserializer, serializer)
    return grpc.unary_unary_rpc_method_handler(refuse, deserializer, serializer)
