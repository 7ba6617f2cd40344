"""Connectors composed into the one the engine sees: a prefill worker's hand-off with the shared KV tier.

Each hook goes to every part in order, and each part gets back only its own part of a step's meta. At
admission the first part that loads a request's first tokens (`num_external_tokens`) or the blocks after
its local hit (`blocks_after_hit`) is the one that loads them. On the forward thread every part's
`wait_for_save` runs before any part's `load_kv`: a load may overwrite blocks a part's transfer still read.
"""

from __future__ import annotations

import asyncio
from concurrent.futures import Future
from dataclasses import dataclass
from typing import TYPE_CHECKING

from workers.engine.connector import KvConnector, KvConnectorStats, KvSent, NullConnector
from workers.engine.kv_transfer import KvConnectorMeta
from workers.runner.kv_pool import KvPool

if TYPE_CHECKING:
    from workers.engine.kv_cache_manager import KVCacheManager
    from workers.engine.request import EngineRequest
    from workers.engine.schedule import SchedulerOutput


@dataclass(frozen=True)
class MultiMeta(KvConnectorMeta):
    parts: tuple[KvConnectorMeta, ...] = ()  # each part's own, in the parts' order

    def loads_kv(self) -> bool:
        return any(part.loads_kv() for part in self.parts)


class MultiConnector(KvConnector):
    def __init__(self, parts: list[KvConnector]) -> None:
        if len(parts) < 2:
            raise ValueError("compose two connectors or more; give the engine a single one as it is")
        self.parts = tuple(parts)
        self._hit_loader: dict[str, KvConnector] = {}  # by request id: the part that offered blocks after its hit

    def part(self, kind: type[KvConnector]) -> KvConnector | None:
        """The part of that type, if any."""
        return next((part for part in self.parts if isinstance(part, kind)), None)

    # ---- scheduler side -------------------------------------------------------------------------------

    async def prepare(self, request: EngineRequest) -> None:
        await asyncio.gather(*(part.prepare(request) for part in self.parts))

    def discard(self, request: EngineRequest) -> None:
        for part in self.parts:
            part.discard(request)

    def add_request(self, request: EngineRequest) -> Future[KvSent] | None:
        """The first transfer a part starts stands for the request (one part sends per request)."""
        outcomes = [part.add_request(request) for part in self.parts]
        return next((outcome for outcome in outcomes if outcome is not None), None)

    def num_external_tokens(self, request: EngineRequest) -> int:
        return next((n for part in self.parts if (n := part.num_external_tokens(request))), 0)

    def blocks_after_hit(self, request: EngineRequest, hit_blocks: int) -> int:
        self._hit_loader.pop(request.request_id, None)
        for part in self.parts:
            if count := part.blocks_after_hit(request, hit_blocks):
                self._hit_loader[request.request_id] = part
                return count
        return 0

    def load_after_hit(self, request: EngineRequest, hit_blocks: int, block_ids: list[int]) -> None:
        loader = self._hit_loader.pop(request.request_id, None)
        for part in self.parts:
            part.load_after_hit(request, hit_blocks, block_ids if part is loader else [])

    def build_meta(self, out: SchedulerOutput, kv: KVCacheManager) -> KvConnectorMeta:
        return MultiMeta(parts=tuple(part.build_meta(out, kv) for part in self.parts))

    def request_preempted(self, request: EngineRequest) -> None:
        for part in self.parts:
            part.request_preempted(request)

    def request_finished(self, request: EngineRequest) -> None:
        self._hit_loader.pop(request.request_id, None)
        for part in self.parts:
            part.request_finished(request)

    def step_done(self, meta: KvConnectorMeta) -> None:
        for part, own in self._each(meta):
            part.step_done(own)

    def before_update(self, out: SchedulerOutput) -> None:
        for part in self.parts:
            part.before_update(out)

    async def after_update(self, out: SchedulerOutput) -> None:
        for part in self.parts:
            await part.after_update(out)

    def stats(self) -> KvConnectorStats:
        sent: dict[str, int] = {}
        received: dict[str, int] = {}
        tier = None
        for stats in (part.stats() for part in self.parts):
            for path, nbytes in stats.sent_by_path.items():
                sent[path] = sent.get(path, 0) + nbytes
            for path, nbytes in stats.received_by_path.items():
                received[path] = received.get(path, 0) + nbytes
            tier = tier or stats.tier
        return KvConnectorStats(sent_by_path=sent, received_by_path=received, tier=tier)

    async def close(self) -> None:
        for part in self.parts:
            await part.close()

    # ---- worker side ------------------------------------------------------------------------------------

    def wait_for_save(self, meta: KvConnectorMeta) -> None:
        for part, own in self._each(meta):
            part.wait_for_save(own)

    def load_kv(self, meta: KvConnectorMeta, runner: KvPool) -> None:
        for part, own in self._each(meta):
            part.load_kv(own, runner)

    def save_kv(self, meta: KvConnectorMeta, runner: KvPool) -> None:
        for part, own in self._each(meta):
            part.save_kv(own, runner)

    def _each(self, meta: KvConnectorMeta) -> zip[tuple[KvConnector, KvConnectorMeta]]:
        assert isinstance(meta, MultiMeta) and len(meta.parts) == len(self.parts)
        return zip(self.parts, meta.parts, strict=True)


def composed(parts: list[KvConnector]) -> KvConnector:
    """The connector an engine gets from these parts: the null connector, the one, or them composed."""
    if len(parts) < 2:
        return parts[0] if parts else NullConnector()
    return MultiConnector(parts)


def parts_of(connector: KvConnector) -> tuple[KvConnector, ...]:
    """The connectors that move KV an engine's connector is made of (none for the null connector)."""
    if isinstance(connector, MultiConnector):
        return connector.parts
    return (connector,) if connector.moves_kv else ()
