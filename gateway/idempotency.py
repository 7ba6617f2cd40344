"""Idempotency keys, with Stripe's semantics, kept by the control plane so that every gateway agrees.

A key belongs to one organization and names one request. The first request with a key claims it and
runs as a new execution. While it runs, another request with the key is refused (ABORTED: retry later).
Once it completed, a request with the key and the same parameters gets the stored final response back
(nothing runs, nothing is billed again: the first execution was); with other parameters it is refused
(INVALID_ARGUMENT). An execution that failed or was cancelled releases the key, so a retry runs anew and
is billed as the new execution it is. A gateway that died holding a key holds it until its lease ends.
"""

import asyncio
import hashlib
import logging

import grpc
from google.protobuf import json_format

from diptych._proto.v1 import inference_pb2
from gateway.control_plane import ControlPlaneClient, ControlPlaneUnavailable
from gateway.errors import GatewayError

log = logging.getLogger(__name__)

MAX_LEASE_S = 24 * 3600
COMPLETE_TIMEOUT_S = 2.0


def fingerprint(request: inference_pb2.GenerateRequest) -> str:
    """The request's parameters, without the fields that only name it."""
    essence = inference_pb2.GenerateRequest()
    essence.CopyFrom(request)
    essence.ClearField("request_id")
    essence.ClearField("idempotency_key")
    return hashlib.sha256(essence.SerializeToString(deterministic=True)).hexdigest()


class IdempotencyKeys:
    def __init__(self, control_plane: ControlPlaneClient) -> None:
        self._control_plane = control_plane
        self._background: set[asyncio.Task] = set()

    async def claim(
        self, organization_id: str, key: str, request: inference_pb2.GenerateRequest, execution_id: str, lease_s: float
    ) -> inference_pb2.GenerateResponse | None:
        """None when this execution may run; the stored response when a completed one answers instead."""
        try:
            claim = await self._control_plane.claim_idempotency_key({
                "organization_id": organization_id, "key": key, "fingerprint": fingerprint(request),
                "execution_id": execution_id, "lease_seconds": max(1, min(MAX_LEASE_S, round(lease_s))),
            })
        except ControlPlaneUnavailable:
            raise GatewayError(
                grpc.StatusCode.UNAVAILABLE,
                "cannot check the idempotency key now (control plane unreachable); retry shortly, or send the "
                "request without an idempotency key",
            ) from None
        outcome = claim["outcome"]
        if outcome == "claimed":
            return None
        if outcome == "completed":
            return json_format.ParseDict(claim["response"], inference_pb2.GenerateResponse())
        if outcome == "in_flight":
            raise GatewayError(
                grpc.StatusCode.ABORTED,
                f"a request with this idempotency key is still running (request {claim['execution_id']}); "
                "retry after it has finished to get its result",
            )
        raise GatewayError(
            grpc.StatusCode.INVALID_ARGUMENT,
            "this idempotency key was already used with different parameters; use a new key for a new request",
        )

    async def complete(
        self, organization_id: str, key: str, execution_id: str, response: inference_pb2.GenerateResponse
    ) -> None:
        """Stores the whole result under the key; if the control plane does not take it in time, the key
        stays claimed until its lease ends."""
        body = {
            "organization_id": organization_id, "key": key, "execution_id": execution_id,
            "response": json_format.MessageToDict(response),
        }
        try:
            await asyncio.wait_for(self._send(self._control_plane.complete_idempotency_key, body), COMPLETE_TIMEOUT_S)
        except TimeoutError:
            log.warning("could not store the result of %s under its idempotency key in time", execution_id)

    def release(self, organization_id: str, key: str, execution_id: str) -> None:
        self._in_background(self._control_plane.release_idempotency_key, organization_id, key, execution_id, {})

    def _in_background(self, call, organization_id: str, key: str, execution_id: str, extra: dict) -> None:
        """After a failed stream: the client does not wait for it. If it fails, the key's lease ends it."""
        body = {"organization_id": organization_id, "key": key, "execution_id": execution_id, **extra}
        task = asyncio.get_running_loop().create_task(self._send(call, body))
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    @staticmethod
    async def _send(call, body: dict) -> None:
        try:
            await call(body)
        except Exception as error:
            log.warning("could not update idempotency key of %s: %r", body["execution_id"], error)

    async def wait_idle(self, timeout_s: float) -> None:
        """Lets the releases still in flight finish, for at most `timeout_s` (a key not released in time is
        freed when its lease ends)."""
        if self._background:
            await asyncio.wait(self._background, timeout=timeout_s)
