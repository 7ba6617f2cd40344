"""API key authentication against the control plane, cached for a few seconds so that a revoked key
stops working within that time without a control-plane call per request."""

import time
from dataclasses import dataclass

import grpc

from gateway.control_plane import ControlPlaneClient, ControlPlaneUnavailable
from gateway.errors import GatewayError


@dataclass(frozen=True)
class Caller:
    organization_id: str
    api_key_id: str


class Authenticator:
    def __init__(self, control_plane: ControlPlaneClient, ttl_s: float = 5.0) -> None:
        self._control_plane = control_plane
        self._ttl_s = ttl_s
        self._cache: dict[str, tuple[Caller | None, float]] = {}

    async def authenticate(self, metadata: tuple[tuple[str, str], ...]) -> Caller:
        api_key = _bearer_token(metadata)
        cached = self._cache.get(api_key)
        if cached is not None and cached[1] > time.monotonic():
            caller = cached[0]
        else:
            caller = await self._verify(api_key)
            self._cache[api_key] = (caller, time.monotonic() + self._ttl_s)
        if caller is None:
            raise GatewayError(grpc.StatusCode.UNAUTHENTICATED, "the API key is not valid: it is unknown, revoked or expired")
        return caller

    async def _verify(self, api_key: str) -> Caller | None:
        try:
            identity = await self._control_plane.verify_api_key(api_key)
        except ControlPlaneUnavailable:
            raise GatewayError(grpc.StatusCode.UNAVAILABLE, "cannot verify the API key right now; retry shortly") from None
        if identity is None:
            return None
        return Caller(organization_id=identity["organization_id"], api_key_id=identity["api_key_id"])


def _bearer_token(metadata: tuple[tuple[str, str], ...]) -> str:
    for key, value in metadata:
        if key == "authorization":
            scheme, _, token = value.partition(" ")
            if scheme.lower() == "bearer" and token.strip():
                return token.strip()
            break
    raise GatewayError(
        grpc.StatusCode.UNAUTHENTICATED, "missing API key: send the metadata entry 'authorization: Bearer <api key>'"
    )
