"""The shared KV tier as a KV connector: prefix blocks other workers computed are fetched before a request is
queued, and every full block this worker computes is written through.

Fetch (`prepare`): a prompt whose local prefix hit stops short of its full blocks (all but the block holding
its last token, whose logits give the next token) asks the tier for the blocks that follow the hit; the run
the tier holds waits here until admission, where the scheduler loads it after the local hit if that hit
still reaches it (`blocks_after_hit`, `load_after_hit`) and the step writes it into the pool (`load_kv`).

Put (write-through): the full blocks a step computed (a prompt chunk's or decoding's) are those named
between `before_update` and `after_update`; they are copied out of the pool on the forward thread right
after that step, before the pool may reuse them, and shipped by the client's thread, so another worker can
fetch them at once, and a block this worker evicts later is already there. A request that failed shares no
KV (it names no blocks: its values may be what failed it).
"""

from __future__ import annotations

import asyncio
import logging
import time
from concurrent.futures import Executor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
from typing_extensions import override

from diptych_common.prefix_hash import block_hashes
from workers.engine.connector import KvConnector, KvConnectorStats, TierStats
from workers.engine.kv_transfer import KvConnectorMeta, KvLoad
from workers.kv_tier.blocks import TierKv, blocks_from_bytes, copy_blocks_out
from workers.kv_tier.client import TierClient
from workers.runner.kv_pool import KvPool

if TYPE_CHECKING:
    from workers.engine.kv_cache_manager import KVCacheManager, NamingMark
    from workers.engine.request import EngineRequest
    from workers.engine.schedule import SchedulerOutput

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class TierPut:
    block_hash: int
    block_id: int


@dataclass(frozen=True)
class TierMeta(KvConnectorMeta):
    """The step's loads, with the fetched blocks each writes (`data[i]` into `loads[i].block_ids`)."""

    data: list[torch.Tensor] = field(default_factory=list)


class TierConnector(KvConnector):
    def __init__(self, client: TierClient, kv: KVCacheManager, runner: KvPool, executor: Executor) -> None:
        """`kv`, `runner`: the engine's block manager and pool; `executor`: its forward thread (puts copy
        blocks out of the pool there)."""
        if client.block_nbytes != runner.layout.block_nbytes:
            raise ValueError(
                f"the KV tier client expects blocks of {client.block_nbytes} bytes; this pool's hold "
                f"{runner.layout.block_nbytes}"
            )
        if not kv.enable_prefix_caching:
            raise ValueError("the KV tier shares named prefix blocks: it needs prefix caching on")
        self.client = client
        self._kv = kv
        self._runner = runner
        self._executor = executor
        self._fetched: dict[str, TierKv] = {}  # by request id, from prepare to admission
        self._admitted: list[tuple[KvLoad, torch.Tensor]] = []  # loads for the next step
        self._loaded_tokens = 0  # by the step that runs now
        self._marks: list[tuple[int, NamingMark]] = []  # the last step's, from before_update
        self.hit_tokens = 0
        self.queried_tokens = 0
        self._staging = 0  # copies under way

    # ---- scheduler side: fetches --------------------------------------------------------------------

    async def prepare(self, request: EngineRequest) -> None:
        if not self.holds(request.request_id) and (fetched := await self._fetch(request)) is not None:
            self.hold(request.request_id, fetched)

    def hold(self, request_id: str, fetched: TierKv) -> None:
        """Keeps blocks fetched for the request until its admission loads them (or finds them of no use)."""
        self._fetched[request_id] = fetched

    def holds(self, request_id: str) -> bool:
        return request_id in self._fetched

    async def _fetch(self, request: EngineRequest) -> TierKv | None:
        """The run of the prompt's full blocks after its local prefix hit that the tier holds, or None."""
        kv, tokens = self._kv, request.all_token_ids
        usable = (len(tokens) - 1) // kv.block_size
        local = len(kv.find_prefix(tokens, request.cache_salt).blocks)
        if local >= usable:
            return None
        hashes = block_hashes(tokens[: usable * kv.block_size], kv.block_size, request.cache_salt)[local:]
        self.queried_tokens += len(hashes) * kv.block_size
        blocks = await self.client.fetch(hashes)
        if not blocks:
            return None
        return TierKv(local, hashes[: len(blocks)], blocks_from_bytes(blocks, self._runner.layout))

    def discard(self, request: EngineRequest) -> None:
        self._fetched.pop(request.request_id, None)

    def blocks_after_hit(self, request: EngineRequest, hit_blocks: int) -> int:
        return self._usable(request, hit_blocks)[1]

    def _usable(self, request: EngineRequest, hit_blocks: int) -> tuple[int, int]:
        """(blocks to skip, blocks to load) of the request's fetched blocks after a prefix hit of `hit_blocks`:
        none when the hit no longer reaches their first block (they would not follow it)."""
        fetched = self._fetched.get(request.request_id)
        if fetched is None or hit_blocks < fetched.first_block:
            return 0, 0
        skip = hit_blocks - fetched.first_block
        last_usable = (request.num_tokens - 1) // self._kv.block_size  # the last token is always computed
        count = min(fetched.num_blocks, last_usable - fetched.first_block) - skip
        return skip, max(0, count)

    def load_after_hit(self, request: EngineRequest, hit_blocks: int, block_ids: list[int]) -> None:
        skip, count = self._usable(request, hit_blocks)
        fetched = self._fetched.pop(request.request_id, None)  # loaded now, or of no use any more
        if fetched is None or not block_ids:
            return
        if len(block_ids) != count:
            raise ValueError(f"{len(block_ids)} blocks were allocated for {count} fetched blocks to load")
        self._admitted.append((KvLoad(request.request_id, block_ids), fetched.data[:, :, skip : skip + count]))

    @override
    def build_meta(self, out: SchedulerOutput, kv: KVCacheManager) -> KvConnectorMeta:
        admitted, self._admitted = self._admitted, []
        self._loaded_tokens = sum(len(load.block_ids) for load, _ in admitted) * kv.block_size
        return TierMeta(loads=[load for load, _ in admitted], data=[data for _, data in admitted])

    def request_finished(self, request: EngineRequest) -> None:
        self._fetched.pop(request.request_id, None)  # it left while queued

    # ---- scheduler side: write-through ----------------------------------------------------------------

    def before_update(self, out: SchedulerOutput) -> None:
        """Where each chunk's request's names stand, with the index of the first block the chunk computes
        into (blocks before it were cached or loaded, not computed)."""
        self.hit_tokens += self._loaded_tokens  # the step ran: what it loaded counts
        self._loaded_tokens = 0
        self._marks = []
        for chunk in out.chunks:
            mark = self._kv.mark_names(chunk.request.request_id)
            if mark is not None:
                self._marks.append((chunk.start // self._kv.block_size, mark))

    @override
    async def after_update(self, out: SchedulerOutput) -> None:
        """Copies the blocks the step filled (named since the marks) that the tier may lack out of the pool on
        the forward thread, and queues them for the tier."""
        puts = [
            TierPut(block_hash, block_id)
            for first_computed, mark in self._marks
            for index, block_hash, block_id in mark.named_since()
            if index >= first_computed and self.client.wants(block_hash)
        ]
        self._marks = []
        if not puts:
            return
        self._staging += 1
        try:
            await asyncio.get_running_loop().run_in_executor(self._executor, self._copy_out, puts)
        except Exception:
            log.exception("copying %d blocks out for the KV tier failed", len(puts))
        finally:
            self._staging -= 1

    def _copy_out(self, puts: list[TierPut]) -> None:
        datas = copy_blocks_out(self._runner, [put.block_id for put in puts])
        self.client.put([(put.block_hash, data) for put, data in zip(puts, datas, strict=True)])

    async def flush(self, timeout: float = 5.0) -> bool:
        """Waits until the blocks of the steps run so far are copied out and shipped (tests, benchmarks: a
        request's last blocks are staged just after its last token was handed out); False on timeout."""
        deadline = time.monotonic() + timeout
        while self._staging and time.monotonic() < deadline:
            await asyncio.sleep(0.002)
        return not self._staging and await self.client.flush(max(0.0, deadline - time.monotonic()))

    def stats(self) -> KvConnectorStats:
        client = self.client.stats()
        tier = TierStats(self.hit_tokens, self.queried_tokens, client.blocks_put, client.blocks_dropped, client.errors)
        return KvConnectorStats(tier=tier)

    async def close(self) -> None:
        await self.client.close()

    # ---- worker side ------------------------------------------------------------------------------------

    def load_kv(self, meta: KvConnectorMeta, runner: KvPool) -> None:
        """Writes the fetched blocks; a composed connector's transfers no longer read what they overwrite
        (their wait_for_save ran first)."""
        assert isinstance(meta, TierMeta)
        for load, data in zip(meta.loads, meta.data, strict=True):
            runner.write_blocks(load.block_ids, data)
