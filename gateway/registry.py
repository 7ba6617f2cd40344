"""The gateway's view of the model catalog and the live workers, refreshed from the control plane.

The control plane's liveness lags behind what the gateway sees itself: right after a control-plane
outage its registry may omit workers whose heartbeats have not come in yet. A worker this gateway has
seen ready stays in its view, as ready, while `is_alive` (its own live-load stream from the worker is
fresh) says so, even when the registry omits it or calls it dead; a drain the registry lists is
honoured at once. While the registry cannot be fetched at all, the last view is kept.
"""

import asyncio
import logging
from collections.abc import Callable
from dataclasses import dataclass

from gateway.control_plane import ControlPlaneClient

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ModelInfo:
    name: str
    source: str
    context_length: int


@dataclass(frozen=True)
class WorkerInfo:
    id: str
    role: str
    model: str
    region: str
    address: str
    state: str
    queue_depth: int
    active_sequences: int


class Registry:
    def __init__(
        self,
        control_plane: ControlPlaneClient,
        refresh_interval_s: float = 1.0,
        on_refresh: Callable[[list["WorkerInfo"]], None] | None = None,
        is_alive: Callable[[str], bool] | None = None,
    ) -> None:
        self._control_plane = control_plane
        self._refresh_interval_s = refresh_interval_s
        self._on_refresh = on_refresh
        self._is_alive = is_alive
        self.models: dict[str, ModelInfo] = {}
        self.workers: list[WorkerInfo] = []

    async def refresh(self) -> None:
        snapshot = await self._control_plane.registry()
        self.models = {
            m["name"]: ModelInfo(m["name"], m["source"], int(m["context_length"])) for m in snapshot["models"]
        }
        listed = [
            WorkerInfo(
                id=w["id"],
                role=w["role"],
                model=w["model"],
                region=w["region"],
                address=w["address"],
                state=w["state"],
                queue_depth=int(w.get("queue_depth", 0)),
                active_sequences=int(w.get("active_sequences", 0)),
            )
            for w in snapshot["workers"]
        ]
        self.workers = [w for w in listed if w.state != "dead"] + self._still_alive_beyond(listed)
        if self._on_refresh is not None:
            self._on_refresh(self.workers)

    async def refresh_forever(self) -> None:
        while True:
            try:
                await self.refresh()
            except Exception as error:  # unreachable, an error status or a bad body: keep the last snapshot
                log.warning("registry refresh failed, keeping the last snapshot: %r", error)
            await asyncio.sleep(self._refresh_interval_s)

    def _still_alive_beyond(self, listed: list[WorkerInfo]) -> list[WorkerInfo]:
        """Workers this gateway saw ready that the registry now omits or calls dead, but whose live load
        this gateway still receives fresh."""
        if self._is_alive is None:
            return []
        listed_live = {w.id for w in listed if w.state != "dead"}
        return [w for w in self.workers if w.state == "ready" and w.id not in listed_live and self._is_alive(w.id)]

    def ready_workers(self, model: str, role: str) -> list[WorkerInfo]:
        return [w for w in self.workers if w.model == model and w.role == role and w.state == "ready"]
