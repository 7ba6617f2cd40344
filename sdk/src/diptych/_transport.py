"""Where the gateway is and how to open a channel to it."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from urllib.parse import urlsplit

import grpc
import grpc.aio

from diptych_proto.v1.inference_pb2_grpc import InferenceStub

from ._version import __version__

DEFAULT_BASE_URL = "grpc://127.0.0.1:50051"
_DEFAULT_PORTS = {"grpc": 50051, "grpcs": 443}
_CHANNEL_OPTIONS = (("grpc.primary_user_agent", f"diptych-python/{__version__}"),)
# The generated stub's __init__ has no annotations; calling it through this typed name keeps mypy --strict clean.
_new_stub: Callable[[grpc.Channel | grpc.aio.Channel], InferenceStub] = InferenceStub


@dataclass(frozen=True, slots=True)
class Endpoint:
    target: str  # "host:port" as gRPC expects it
    secure: bool


def parse_base_url(base_url: str) -> Endpoint:
    """Parses `grpc://host:port` (plaintext), `grpcs://host:port` (TLS) or bare `host:port` (plaintext)."""
    parts = urlsplit(base_url if "://" in base_url else f"grpc://{base_url}")
    scheme = parts.scheme.lower()
    try:
        hostname, port = parts.hostname, parts.port
    except ValueError:  # a port that is not a number from 0 to 65535
        hostname = port = None
    extras = parts.path not in ("", "/") or parts.query or parts.fragment or parts.username is not None
    if scheme not in _DEFAULT_PORTS or not hostname or extras:
        raise ValueError(f"base_url {base_url!r} must look like grpc://host:port, grpcs://host:port or host:port")
    host = f"[{hostname}]" if ":" in hostname else hostname
    port = _DEFAULT_PORTS[scheme] if port is None else port
    return Endpoint(target=f"{host}:{port}", secure=scheme == "grpcs")


def auth_metadata(api_key: str) -> tuple[tuple[str, str], ...]:
    return (("authorization", f"Bearer {api_key}"),)


class SyncTransport:
    """Owns the client's single gRPC channel."""

    def __init__(self, endpoint: Endpoint) -> None:
        if endpoint.secure:
            self._channel = grpc.secure_channel(endpoint.target, grpc.ssl_channel_credentials(), _CHANNEL_OPTIONS)
        else:
            self._channel = grpc.insecure_channel(endpoint.target, _CHANNEL_OPTIONS)
        self._stub: InferenceStub | None = _new_stub(self._channel)

    @property
    def stub(self) -> InferenceStub:
        if self._stub is None:
            raise RuntimeError("The client has been closed")
        return self._stub

    def close(self) -> None:
        self._stub = None
        self._channel.close()


class AsyncTransport:
    """Owns the client's single grpc.aio channel, opened on first use.

    A grpc.aio channel binds to the event loop running when it is created, and
    clients are usually built before any loop runs.
    """

    def __init__(self, endpoint: Endpoint) -> None:
        self._endpoint = endpoint
        self._channel: grpc.aio.Channel | None = None
        self._stub: InferenceStub | None = None
        self._closed = False

    @property
    def stub(self) -> InferenceStub:
        if self._closed:
            raise RuntimeError("The client has been closed")
        if self._stub is None:
            if self._endpoint.secure:
                credentials = grpc.ssl_channel_credentials()
                self._channel = grpc.aio.secure_channel(self._endpoint.target, credentials, _CHANNEL_OPTIONS)
            else:
                self._channel = grpc.aio.insecure_channel(self._endpoint.target, _CHANNEL_OPTIONS)
            self._stub = _new_stub(self._channel)
        return self._stub

    async def close(self) -> None:
        self._closed = True
        if self._channel is not None:
            await self._channel.close()
