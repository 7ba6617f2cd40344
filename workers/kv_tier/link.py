"""The engine's side of the KV tier: what it fetches for a request before queueing it, and what it puts.

Fetch: a prompt whose local prefix hit stops short of its full blocks (all but the block holding its last
token, whose logits give the next token) asks the tier for the blocks that follow the hit; the run the tier
holds travels with the request (`TierKv`) and the scheduler loads it at admission if the local hit still
reaches it.

Put (write-through): every full block a step completed (a prompt chunk's or decoding's) is copied out of
the pool on the forward thread right after that step, before the pool may reuse it, and shipped to the tier
by the client's thread, so another worker can fetch it at once, and a block this worker evicts later is
already there. A request that failed shares no KV (its values may be what failed it).
"""

import asyncio
import time
from concurrent.futures import Executor
from dataclasses import dataclass

from diptych_common.prefix_hash import block_hashes
from workers.kv_cache_manager import KVCacheManager, NamingMark
from workers.kv_pool import KvLayout, KvPool
from workers.kv_tier.blocks import TierKv, blocks_from_bytes, copy_blocks_out
from workers.kv_tier.client import TierClient
from workers.request import EngineRequest
from workers.scheduler import SchedulerOutput


@dataclass(frozen=True)
class TierPut:
    block_hash: int
    block_id: int


class EngineTier:
    def __init__(self, client: TierClient, layout: KvLayout) -> None:
        if client.block_nbytes != layout.block_nbytes:
            raise ValueError(
                f"the KV tier client expects blocks of {client.block_nbytes} bytes; this pool's hold "
                f"{layout.block_nbytes}"
            )
        self.client = client
        self.layout = layout
        self.hit_tokens = 0  # prompt tokens loaded from the tier instead of computed
        self.queried_tokens = 0  # prompt tokens of the requests that asked the tier
        self.blocks_staged = 0  # blocks copied out of the pool for a put
        self._staging = 0  # copies under way

    async def fetch(self, request: EngineRequest, kv: KVCacheManager) -> TierKv | None:
        """The run of the prompt's full blocks after its local prefix hit that the tier holds, or None."""
        tokens = request.all_token_ids
        usable = (len(tokens) - 1) // kv.block_size
        local = len(kv.find_prefix(tokens, request.cache_salt).blocks)
        if local >= usable:
            return None
        hashes = block_hashes(tokens[: usable * kv.block_size], kv.block_size, request.cache_salt)[local:]
        self.queried_tokens += len(hashes) * kv.block_size
        blocks = await self.client.fetch(hashes)
        if not blocks:
            return None
        return TierKv(local, hashes[: len(blocks)], blocks_from_bytes(blocks, self.layout))

    @staticmethod
    def mark(out: SchedulerOutput, kv: KVCacheManager) -> list[tuple[int, NamingMark]]:
        """Before the step's blocks are named: where each chunk's request's names stand, with the index of
        the first block the chunk computes into (blocks before it were cached or loaded, not computed)."""
        marks = []
        for chunk in out.chunks:
            mark = kv.mark_names(chunk.request.request_id)
            if mark is not None:
                marks.append((chunk.start // kv.block_size, mark))
        return marks

    def completed_blocks(self, marks: list[tuple[int, NamingMark]]) -> list[TierPut]:
        """After they were named: the blocks the step filled (named since the marks; a request that failed
        names none) that the tier may lack."""
        puts = []
        for first_computed, mark in marks:
            for index, block_hash, block_id in mark.named_since():
                if index >= first_computed and self.client.wants(block_hash):
                    puts.append(TierPut(block_hash, block_id))
        return puts

    async def stage(self, executor: Executor, runner: KvPool, puts: list[TierPut]) -> None:
        """Copies the blocks out on the forward thread (`executor`) and queues them for the tier."""
        self._staging += 1
        try:
            await asyncio.get_running_loop().run_in_executor(executor, self.copy_out, runner, puts)
        finally:
            self._staging -= 1

    async def flush(self, timeout: float = 5.0) -> bool:
        """Waits until the blocks of the steps run so far are copied out and shipped (tests, benchmarks: a
        request's last blocks are staged just after its last token was handed out); False on timeout."""
        deadline = time.monotonic() + timeout
        while self._staging and time.monotonic() < deadline:
            await asyncio.sleep(0.002)
        return not self._staging and await self.client.flush(max(0.0, deadline - time.monotonic()))

    def copy_out(self, runner: KvPool, puts: list[TierPut]) -> None:
        """On the forward thread: copies the blocks out of the pool and queues them for the tier."""
        datas = copy_blocks_out(runner, [put.block_id for put in puts])
        self.blocks_staged += len(puts)
        self.client.put([(put.block_hash, data) for put, data in zip(puts, datas, strict=True)])
