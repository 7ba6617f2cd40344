"""The workers' live load, as they report it: one WatchLoad stream per worker (a GetLoad poll every
200 ms where a worker does not serve WatchLoad). Routing reads it; it never polls per request.

A worker whose stream broke, or that reported nothing for a while, counts as unreachable until it
reports again, so a worker that died gets no new work even before the control plane marks it dead.
"""

import asyncio
import logging
import time
from dataclasses import dataclass

import grpc

from diptych_common.proto.v1 import worker_pb2, worker_pb2_grpc
from gateway.fleet.channels import Channels
from gateway.fleet.registry import WorkerInfo
from gateway.metrics import QUEUE_DEPTH

log = logging.getLogger(__name__)

POLL_INTERVAL_S = 0.2
STALE_AFTER_S = 3.0
RECONNECT_DELAY_S = 0.3
POLL_TIMEOUT_S = 1.0
# A worker's report of the blocks a request just left it lags the request's end by up to the report
# interval (50 ms); this gateway counts them as held for this long, by which time a report carries them.
FINISHED_BLOCKS_HELD_S = 0.5


@dataclass
class LiveLoad:
    load: worker_pb2.Load | None = None
    updated_at: float = 0.0  # time.monotonic() of the last report
    cached_blocks: frozenset[int] = frozenset()
    cache_version: int = -1
    broken: bool = False  # the last stream or poll failed
    finished_blocks: frozenset[int] = frozenset()  # left by requests that ended here, not yet reported
    finished_until: float = 0.0  # time.monotonic() until which finished_blocks count

    def held_blocks(self) -> tuple[frozenset[int], frozenset[int]]:
        """The blocks the worker holds: those it reported, and those requests left it since."""
        if self.finished_blocks and time.monotonic() < self.finished_until:
            return self.cached_blocks, self.finished_blocks
        return self.cached_blocks, frozenset()

    @property
    def fresh_load(self) -> worker_pb2.Load | None:
        """The last report while it is fresh; None before the first, after a broken stream, or once stale."""
        if self.broken or time.monotonic() - self.updated_at >= STALE_AFTER_S:
            return None
        return self.load


class LoadBoard:
    def __init__(self, channels: Channels) -> None:
        self._channels = channels
        self._live: dict[str, LiveLoad] = {}
        self._roles: dict[str, str] = {}
        self._watches: dict[str, tuple[str, asyncio.Task[None]]] = {}  # worker id -> (address, watching task)

    def sync(self, workers: list[WorkerInfo]) -> None:
        """Watches every worker the registry lists, and stops watching those it no longer lists."""
        wanted = {w.id: w for w in workers if w.state != "dead"}
        for worker_id, (address, task) in list(self._watches.items()):
            if worker_id not in wanted or wanted[worker_id].address != address:
                task.cancel()
                del self._watches[worker_id]
                self._live.pop(worker_id, None)
        for worker_id, worker in wanted.items():
            if worker_id not in self._watches:
                task = asyncio.create_task(self._watch(worker), name=f"load-{worker_id}")
                self._watches[worker_id] = (worker.address, task)

    def get(self, worker_id: str) -> LiveLoad | None:
        return self._live.get(worker_id)

    def fresh_load(self, worker_id: str) -> worker_pb2.Load | None:
        """The worker's last report, while it is fresh."""
        live = self._live.get(worker_id)
        return live.fresh_load if live is not None else None

    def is_fresh(self, worker_id: str) -> bool:
        """The worker reported recently on a working stream: it is alive, whatever the registry says."""
        return self.fresh_load(worker_id) is not None

    def report(self, worker: WorkerInfo, load: worker_pb2.Load) -> None:
        """Records a worker's load report."""
        live = self._live.setdefault(worker.id, LiveLoad())
        self._roles[worker.id] = worker.role
        live.load = load
        live.updated_at = time.monotonic()
        live.broken = False
        summary = load.prefix_cache
        if summary.version != live.cache_version or len(summary.block_hashes) != len(live.cached_blocks):
            live.cached_blocks = frozenset(summary.block_hashes)
            live.cache_version = summary.version
        self._publish_queue_depth(worker.role)

    def note_finished(self, worker_id: str, blocks: list[int]) -> None:
        """A request ended on the worker, leaving it the KV of `blocks` (its full blocks' names): count
        them as held until its reports have had time to carry them."""
        live = self._live.get(worker_id)
        if live is None:
            return
        now = time.monotonic()
        earlier = live.finished_blocks if now < live.finished_until else frozenset()
        live.finished_blocks = earlier.union(blocks)
        live.finished_until = now + FINISHED_BLOCKS_HELD_S

    def mark_broken(self, worker_id: str) -> None:
        """The worker's stream or a call to it failed as a dead worker's would: route nothing to it
        until it reports again."""
        self._live.setdefault(worker_id, LiveLoad()).broken = True

    def close(self) -> None:
        for _, task in self._watches.values():
            task.cancel()
        self._watches.clear()

    async def _watch(self, worker: WorkerInfo) -> None:
        stub = self._channels.stub(worker.address)
        while True:
            try:
                call = stub.WatchLoad(worker_pb2.LoadRequest(), metadata=self._channels.metadata())
                try:
                    while True:
                        load = await asyncio.wait_for(call.read(), STALE_AFTER_S)
                        if load is grpc.aio.EOF:
                            break
                        self.report(worker, load)
                        if load.draining:
                            break
                finally:
                    call.cancel()
                live = self._live.get(worker.id)
                if live is not None and live.load is not None and live.load.draining:
                    await self._poll(worker, stub, while_draining=True)
                    continue
            except grpc.aio.AioRpcError as error:
                if error.code() is grpc.StatusCode.UNIMPLEMENTED:
                    await self._poll(worker, stub)
                    return
                self.mark_broken(worker.id)
            except TimeoutError:
                self.mark_broken(worker.id)
            except Exception as error:  # keep watching whatever went wrong
                log.warning("watching the load of %s failed: %r", worker.id, error)
                self.mark_broken(worker.id)
            await asyncio.sleep(RECONNECT_DELAY_S)

    async def _poll(self, worker: WorkerInfo, stub: worker_pb2_grpc.WorkerStub, while_draining: bool = False) -> None:
        """GetLoad every 200 ms: for workers without WatchLoad, and for draining workers, whose shutdown
        an open stream would hold up (until they stop draining or go away)."""
        while True:
            try:
                load = await stub.GetLoad(worker_pb2.LoadRequest(), timeout=POLL_TIMEOUT_S)
                self.report(worker, load)
                if while_draining and not load.draining:
                    return
            except grpc.aio.AioRpcError:
                self.mark_broken(worker.id)
            await asyncio.sleep(POLL_INTERVAL_S)

    def _publish_queue_depth(self, role: str) -> None:
        total = 0
        for worker_id, live in self._live.items():
            load = live.fresh_load
            if load is not None and self._roles.get(worker_id) == role:
                total += load.queue_depth
        QUEUE_DEPTH.labels(role).set(total)
