"""The gateway's view of the model catalog and the live workers, refreshed from the control plane."""

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
    ) -> None:
        self._control_plane = control_plane
        self._refresh_interval_s = refresh_interval_s
        self._on_refresh = on_refresh
        self.models: dict[str, ModelInfo] = {}
        self.workers: list[WorkerInfo] = []

    async def refresh(self) -> None:
        snapshot = await self._control_plane.registry()
        self.models = {
            m["name"]: ModelInfo(m["name"], m["source"], int(m["context_length"])) for m in snapshot["models"]
        }
        self.workers = [
            WorkerInfo(
                id=w["id"], role=w["role"], model=w["model"], region=w["region"], address=w["address"],
                state=w["state"], queue_depth=int(w.get("queue_depth", 0)),
                active_sequences=int(w.get("active_sequences", 0)),
            )
            for w in snapshot["workers"]
        ]
        if self._on_refresh is not None:
            self._on_refresh(self.workers)

    async def refresh_forever(self) -> None:
        while True:
            try:
                await self.refresh()
            except Exception as error:  # unreachable, an error status or a bad body: keep the last snapshot
                log.warning("registry refresh failed, keeping the last snapshot: %r", error)
            await asyncio.sleep(self._refresh_interval_s)

    def ready_workers(self, model: str, role: str) -> list[WorkerInfo]:
        return [w for w in self.workers if w.model == model and w.role == role and w.state == "ready"]
