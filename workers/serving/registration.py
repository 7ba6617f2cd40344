"""Keeps a worker registered with the control plane: registers with its fleet token, then heartbeats
its load; registers again when the control plane has forgotten it or marked it dead."""

import asyncio
import logging
from collections.abc import Callable
from typing import Any

import httpx

from diptych_common.internal_api.client import ControlPlaneClient, describe_failure
from diptych_common.worker_credential import WorkerSecret

log = logging.getLogger(__name__)

RETRY_DELAY_S = 1.0


class RegistrationError(Exception):
    pass


class ControlPlaneLink:
    def __init__(
        self,
        control_plane_url: str,
        fleet_token: str,
        address: str,
        name: str,
        load: Callable[[], dict[str, int | float]],
        on_state: Callable[[str], None] = lambda _state: None,
        secret: WorkerSecret | None = None,
        http_timeout_s: float = 5.0,
        revision: str = "",
    ) -> None:
        self._control_plane = ControlPlaneClient(control_plane_url, fleet_token, timeout=http_timeout_s)
        self._address = address
        self._name = name
        self._load = load
        self._revision = revision  # the model revision this worker loaded; "" for a builtin or local model
        self._on_state = on_state  # told the state the control plane holds for this worker
        self.secret = secret or WorkerSecret()  # the worker RPC secret, handed over on registration
        self.worker_id = ""
        self.fleet: dict[str, Any] = {}  # the control plane's JSON description of this worker's fleet
        self.heartbeat_interval = 2.0
        self.draining = False

    async def register(self) -> None:
        try:
            body = await self._control_plane.register_worker(
                address=self._address, name=self._name, revision=self._revision
            )
        except httpx.HTTPStatusError as error:
            if error.response.status_code == 401:
                raise RegistrationError(f"the control plane refused the fleet token: {error.response.text}") from None
            raise
        if not body.get("worker_rpc_secret"):
            raise RegistrationError(
                "the control plane handed out no worker RPC secret on registration: it predates authenticated "
                "worker calls; upgrade it to this version"
            )
        self.secret.set(body["worker_rpc_secret"])
        self.worker_id = body["id"]
        self.fleet = body["fleet"]
        self.heartbeat_interval = float(body["heartbeat_interval_seconds"])
        log.info("registered as %s in fleet %s", self.worker_id, self.fleet.get("name"))

    async def register_until_accepted(self) -> None:
        while True:
            try:
                await self.register()
                return
            except httpx.HTTPError as error:
                log.warning("cannot register with the control plane yet (%s); retrying", describe_failure(error))
                await asyncio.sleep(RETRY_DELAY_S)

    async def heartbeat_forever(self) -> None:
        while True:
            await asyncio.sleep(self.heartbeat_interval)
            try:
                await self.heartbeat()
            except httpx.HTTPError as error:
                log.warning("heartbeat failed: %s", describe_failure(error))

    async def heartbeat(self) -> None:
        state = "draining" if self.draining else "ready"
        try:
            body = await self._control_plane.heartbeat(self.worker_id, state, self._load())
        except httpx.HTTPStatusError as error:
            if error.response.status_code not in (404, 410):
                raise
            log.warning(
                "the control plane no longer knows this worker (%s); registering again", error.response.status_code
            )
            await self.register()
            return
        state = body.get("state", "")
        if state == "draining" and not self.draining:
            log.info("the control plane asks this worker to drain")
            self.draining = True
        self._on_state(state)

    async def close(self) -> None:
        await self._control_plane.close()
