"""Where the gateways are and how to open a channel to each.

A base URL may name several gateways, comma-separated (`grpc://gw-a:50051,gw-b:50051`): each call goes to
the next one in turn, so a call retried after a gateway failed to answer goes to another gateway. The
asyncio client also passes over a gateway whose channel is failing to connect while another is not
(grpc.aio's `get_state`; a sync channel tells its state only to a polling thread, which races its close).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterator
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


def parse_base_urls(base_url: str) -> list[Endpoint]:
    """The gateways a base URL names: one, or several separated by commas; a gateway without a scheme
    takes the first one's."""
    parts = [part.strip() for part in base_url.split(",")]
    if not all(parts):
        raise ValueError(f"base_url {base_url!r} has an empty gateway between its commas")
    scheme = parts[0].split("://", 1)[0] + "://" if "://" in parts[0] else ""
    return [parse_base_url(part if "://" in part else scheme + part) for part in parts]


def auth_metadata(api_key: str) -> tuple[tuple[str, str], ...]:
    return (("authorization", f"Bearer {api_key}"),)


def next_in_turn(turn: Iterator[int], failing: Callable[[int], bool], count: int) -> int:
    """The next gateway in turn that is not failing to connect; the next one in turn if all are."""
    first = next(turn) % count
    for offset in range(count):
        index = (first + offset) % count
        if not failing(index):
            return index
    return first


class SyncTransport:
    """Owns the client's gRPC channels, one per gateway."""

    def __init__(self, endpoints: list[Endpoint]) -> None:
        self._channels = [_sync_channel(endpoint) for endpoint in endpoints]
        self._stubs: list[InferenceStub] = [_new_stub(channel) for channel in self._channels]
        self._turn = itertools.count()

    @property
    def stub(self) -> InferenceStub:
        """The next gateway's stub, in turn."""
        if not self._stubs:
            raise RuntimeError("The client has been closed")
        return self._stubs[next(self._turn) % len(self._stubs)]

    def close(self) -> None:
        self._stubs = []
        for channel in self._channels:
            channel.close()


def _sync_channel(endpoint: Endpoint) -> grpc.Channel:
    if endpoint.secure:
        return grpc.secure_channel(endpoint.target, grpc.ssl_channel_credentials(), _CHANNEL_OPTIONS)
    return grpc.insecure_channel(endpoint.target, _CHANNEL_OPTIONS)


class AsyncTransport:
    """Owns the client's grpc.aio channels, one per gateway, opened on first use.

    A grpc.aio channel binds to the event loop running when it is created, and
    clients are usually built before any loop runs.
    """

    def __init__(self, endpoints: list[Endpoint]) -> None:
        self._endpoints = endpoints
        self._channels: list[grpc.aio.Channel] = []
        self._stubs: list[InferenceStub] = []
        self._turn = itertools.count()
        self._closed = False

    @property
    def stub(self) -> InferenceStub:
        """The next gateway's stub, in turn."""
        if self._closed:
            raise RuntimeError("The client has been closed")
        if not self._stubs:
            self._channels = [_async_channel(endpoint) for endpoint in self._endpoints]
            self._stubs = [_new_stub(channel) for channel in self._channels]
        failing = grpc.ChannelConnectivity.TRANSIENT_FAILURE
        index = next_in_turn(self._turn, lambda i: self._channels[i].get_state() is failing, len(self._stubs))
        return self._stubs[index]

    async def close(self) -> None:
        self._closed = True
        for channel in self._channels:
            await channel.close()


def _async_channel(endpoint: Endpoint) -> grpc.aio.Channel:
    if endpoint.secure:
        return grpc.aio.secure_channel(endpoint.target, grpc.ssl_channel_credentials(), _CHANNEL_OPTIONS)
    return grpc.aio.insecure_channel(endpoint.target, _CHANNEL_OPTIONS)
