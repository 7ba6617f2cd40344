"""The internal API's credential: the worker RPC secret, which only the gateway and the workers hold.

The control plane derives it from its secret key and hands it to workers when they register and to the
gateway on its internal API. Every call to a worker carries it as `authorization: Bearer <secret>`; a
decode worker proves it holds it by answering a prefill worker's challenge (`endpoint_proof`), so a
prefill worker sends a KV cache only to a worker the control plane registered.
"""

import hashlib
import hmac
import secrets
from collections.abc import AsyncIterable, Awaitable, Callable, Iterable
from typing import TypeVar

import grpc

from diptych_common.proto.v1 import worker_pb2

METADATA_KEY = "authorization"
SCHEME = "Bearer "
CHALLENGE_BYTES = 32
_PROOF_LABEL = b"diptych kv endpoint v1\0"


class WorkerSecret:
    """The secret as one process holds it: empty until the control plane handed it over."""

    def __init__(self, value: str = "") -> None:
        self._value = value

    @property
    def known(self) -> bool:
        return bool(self._value)

    def set(self, value: str) -> None:
        if not value:
            raise ValueError("the worker RPC secret handed over by the control plane is empty")
        self._value = value

    def metadata(self) -> tuple[tuple[str, str], ...]:
        """What a call to a worker carries."""
        return ((METADATA_KEY, SCHEME + self._value),)

    def refusal(self, metadata: Iterable[tuple[str, str | bytes]] | None) -> str | None:
        """Why a call with this metadata is refused, or None when it carries the secret."""
        if not self._value:
            return (
                "this worker has not registered with the control plane yet, so it cannot check credentials: "
                "it refuses every call until it has"
            )
        presented = dict(metadata or ()).get(METADATA_KEY)
        if not isinstance(presented, str) or not presented.startswith(SCHEME):
            return (
                "worker calls need `authorization: Bearer <worker RPC secret>`: only the gateway and other "
                "workers may call a worker (the control plane hands the secret to them)"
            )
        if not hmac.compare_digest(presented.removeprefix(SCHEME).encode(), self._value.encode()):
            return "the worker RPC secret does not match this worker's: the caller holds an old or foreign secret"
        return None

    def endpoint_proof(self, challenge: bytes, endpoint: worker_pb2.KvEndpoint) -> bytes:
        """HMAC of the challenge and every field of the endpoint but its proof."""
        unsigned = worker_pb2.KvEndpoint()
        unsigned.CopyFrom(endpoint)
        unsigned.ClearField("proof")
        message = _PROOF_LABEL + challenge + unsigned.SerializeToString(deterministic=True)
        return hmac.new(self._value.encode(), message, hashlib.sha256).digest()

    def proves(self, challenge: bytes, endpoint: worker_pb2.KvEndpoint) -> bool:
        return self.known and hmac.compare_digest(endpoint.proof, self.endpoint_proof(challenge, endpoint))


def new_challenge() -> bytes:
    return secrets.token_bytes(CHALLENGE_BYTES)


def attach_worker_secret(secret: WorkerSecret) -> list[grpc.aio.ClientInterceptor]:
    """Client interceptors that add the secret to every call on a channel (read at call time, so it
    may arrive after the channel was made). One per kind of call: a grpc.aio channel files an
    interceptor under the first kind it implements only."""
    return [_UnaryUnary(secret), _UnaryStream(secret), _StreamUnary(secret), _StreamStream(secret)]


class _AttachSecret:
    def __init__(self, secret: WorkerSecret) -> None:
        self._secret = secret

    def _with_secret(self, details: grpc.aio.ClientCallDetails) -> grpc.aio.ClientCallDetails:
        metadata = grpc.aio.Metadata(*(details.metadata or ()), *self._secret.metadata())
        return grpc.aio.ClientCallDetails(
            details.method, details.timeout, metadata, details.credentials, details.wait_for_ready
        )


# The interceptors' methods are generic over the call's request and response messages, as grpc's own are.
_Request = TypeVar("_Request")
_Response = TypeVar("_Response")


class _UnaryUnary(_AttachSecret, grpc.aio.UnaryUnaryClientInterceptor):
    async def intercept_unary_unary(
        self,
        continuation: Callable[
            [grpc.aio.ClientCallDetails, _Request], Awaitable[grpc.aio.UnaryUnaryCall[_Request, _Response]]
        ],
        details: grpc.aio.ClientCallDetails,
        request: _Request,
    ) -> grpc.aio.UnaryUnaryCall[_Request, _Response]:
        return await continuation(self._with_secret(details), request)


class _UnaryStream(_AttachSecret, grpc.aio.UnaryStreamClientInterceptor):
    async def intercept_unary_stream(
        self,
        continuation: Callable[
            [grpc.aio.ClientCallDetails, _Request], Awaitable[grpc.aio.UnaryStreamCall[_Request, _Response]]
        ],
        details: grpc.aio.ClientCallDetails,
        request: _Request,
    ) -> grpc.aio.UnaryStreamCall[_Request, _Response]:
        return await continuation(self._with_secret(details), request)


class _StreamUnary(_AttachSecret, grpc.aio.StreamUnaryClientInterceptor):
    async def intercept_stream_unary(
        self,
        continuation: Callable[
            [grpc.aio.ClientCallDetails, AsyncIterable[_Request] | Iterable[_Request]],
            Awaitable[grpc.aio.StreamUnaryCall[_Request, _Response]],
        ],
        details: grpc.aio.ClientCallDetails,
        request_iterator: AsyncIterable[_Request] | Iterable[_Request],
    ) -> grpc.aio.StreamUnaryCall[_Request, _Response]:
        return await continuation(self._with_secret(details), request_iterator)


class _StreamStream(_AttachSecret, grpc.aio.StreamStreamClientInterceptor):
    async def intercept_stream_stream(
        self,
        continuation: Callable[
            [grpc.aio.ClientCallDetails, AsyncIterable[_Request] | Iterable[_Request]],
            Awaitable[grpc.aio.StreamStreamCall[_Request, _Response]],
        ],
        details: grpc.aio.ClientCallDetails,
        request_iterator: AsyncIterable[_Request] | Iterable[_Request],
    ) -> grpc.aio.StreamStreamCall[_Request, _Response]:
        return await continuation(self._with_secret(details), request_iterator)
