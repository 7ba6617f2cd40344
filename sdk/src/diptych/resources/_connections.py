"""What the resources use of the client that owns them, so that they depend on these protocols, not on the
client classes (which import the resources)."""

from __future__ import annotations

from typing import Protocol

from diptych_proto.v1.inference_pb2_grpc import InferenceStub

from .._gateway_http import GatewayHttpTransport
from .._http import AdminTransport


class GatewayChannel(Protocol):
    @property
    def stub(self) -> InferenceStub: ...


class ClientOptions(Protocol):
    """The client's defaults, read at each call (`with_options` gives a client other ones)."""

    @property
    def timeout(self) -> float | None: ...

    @property
    def max_retries(self) -> int: ...


class GatewayConnection(ClientOptions, Protocol):
    """What completions, chat and models use: the options, the API key's metadata and the gRPC channel."""

    @property
    def stream_idle_timeout(self) -> float | None: ...

    @property
    def _metadata(self) -> tuple[tuple[str, str], ...]: ...

    @property
    def _transport(self) -> GatewayChannel: ...


class ControlPlaneConnection(ClientOptions, Protocol):
    """What admin, files and batches use: the options and the control plane's HTTP transport."""

    @property
    def _admin_transport(self) -> AdminTransport: ...


class GatewayHttpConnection(ClientOptions, Protocol):
    """What responses use: the options and the gateway's HTTP transport."""

    @property
    def _http_transport(self) -> GatewayHttpTransport: ...
