"""The gateway's view of the model catalog and the live workers, refreshed from the control plane.

The control plane's liveness lags behind what the gateway sees itself: right after a control-plane
outage its registry may omit workers whose heartbeats have not come in yet. A worker this gateway has
seen ready stays in its view, as ready, while `is_alive` (its own live-load stream from the worker is
fresh) says so, even when the registry omits it or calls it dead; a drain the registry lists is
honoured at once. While the registry cannot be fetched at all, the last view is kept.

A model published as artifacts (catalog source `artifacts`) has no source the gateway can read: its
tokenizer comes from the current revision's files without the weights, fetched and verified into the
gateway's cache (`tokenizer_files`), once per revision; `ModelInfo.source` is then that directory. A model
whose files cannot be fetched keeps its last known revision, or stays out of the view until they can.
"""

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from diptych_common.internal_api.client import ControlPlaneClient
from diptych_common.logs import describe_error

log = logging.getLogger(__name__)


ARTIFACTS_SOURCE = "artifacts"


@dataclass(frozen=True)
class ModelInfo:
    name: str
    source: str  # where the tokenizer loads from: builtin:<name> or a local directory
    context_length: int
    revision: str = ""  # the published revision ("" unless the model is published as artifacts)
    created: int = 0  # when the catalog added it, in seconds since the epoch (`GET /v1/models`' `created`)


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
        tokenizer_files: Callable[[str], str] | None = None,
    ) -> None:
        self._control_plane = control_plane
        self._refresh_interval_s = refresh_interval_s
        self._on_refresh = on_refresh
        self._is_alive = is_alive
        self._tokenizer_files = tokenizer_files  # model name -> the directory of its current revision's files
        self.models: dict[str, ModelInfo] = {}
        self.workers: list[WorkerInfo] = []

    async def refresh(self) -> None:
        snapshot = await self._control_plane.registry()
        models = [await self._model_info(m) for m in snapshot["models"]]
        self.models = {model.name: model for model in models if model is not None}
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

    async def _model_info(self, listed: dict[str, Any]) -> ModelInfo | None:
        name, source, revision = listed["name"], listed["source"], listed.get("revision", "")
        created = self._created(listed)
        if source != ARTIFACTS_SOURCE:
            return ModelInfo(name, source, int(listed["context_length"]), created=created)
        known = self.models.get(name)
        if known is not None and known.revision == revision:
            return known
        if self._tokenizer_files is None:
            log.warning("%s is published as artifacts, but this gateway has no artifact cache", name)
            return known
        try:
            directory = await asyncio.to_thread(self._tokenizer_files, name)
        except Exception as error:  # a store or network fault, or a checksum refused: keep what we had
            log.warning("cannot fetch the tokenizer of %s@%s: %s", name, revision, describe_error(error))
            return known
        return ModelInfo(name, directory, int(listed["context_length"]), revision, created)

    def _created(self, listed: dict[str, Any]) -> int:
        """When the catalog added the model; where the control plane does not say (an earlier version of
        it), when this gateway first listed the model."""
        if listed.get("created_at"):
            return int(datetime.fromisoformat(listed["created_at"]).timestamp())
        known = self.models.get(listed["name"])
        return known.created if known is not None else int(time.time())

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
