"""A worker's client of the KV tier's store.

Puts never hold the engine up: blocks go on a bounded queue that a thread of the client's own ships to the
store (a full queue drops them: the tier is a cache), and a block the store is known to hold is not sent
again. Fetches are awaited on the event loop (grpc.aio) and checked block by block (length, checksum);
anything wrong (the store unreachable, slow or answering damaged bytes) makes the fetch come back empty, so
the worker computes the blocks itself. After a failed call the client leaves the store alone for a moment
rather than add a failing round trip to every request.
"""

import asyncio
import logging
import queue
import threading
import time
from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass

import grpc

from diptych_common.proto.v1 import kv_tier_pb2, kv_tier_pb2_grpc
from diptych_common.worker_credential import WorkerSecret, attach_worker_secret
from workers.kv_tier.store import checksum

log = logging.getLogger(__name__)

FETCH_TIMEOUT_S = 2.0
PUT_TIMEOUT_S = 5.0
RETRY_AFTER_S = 1.0  # after a failed call, the store is left alone this long
MAX_PUT_BYTES = 16 << 20  # per Put call
MAX_GET_BYTES = 32 << 20  # per Get reply
MAX_MESSAGE_BYTES = 64 << 20
PARALLEL_GETS = 4  # a fetch's Gets at once
MIN_PART_BLOCKS = 4
CHANNEL_OPTIONS = [
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    # Bulk bytes: a stream's flow-control window opens to the message size at once, not by probing.
    ("grpc.http2.bdp_probe", 0),
    ("grpc.http2.lookahead_bytes", MAX_MESSAGE_BYTES),
]


@dataclass(frozen=True)
class TierClientStats:
    blocks_put: int  # blocks shipped to the store
    blocks_dropped: int  # blocks dropped unsent: the queue was full, or the store was unreachable
    queue_full: int  # of those, the blocks dropped because the queue was full
    blocks_fetched: int  # checked blocks fetched
    errors: int  # calls that failed, and fetched blocks that failed their check


class TierClient:
    def __init__(
        self,
        address: str,
        namespace: str,
        block_nbytes: int,
        secret: WorkerSecret,
        queue_bytes: int = 256 << 20,
        known_blocks: int = 1 << 16,
        put_timeout_s: float = PUT_TIMEOUT_S,
    ) -> None:
        if not address or ":" not in address:
            raise ValueError(f"the KV tier's address must be HOST:PORT, not {address!r}")
        self.address = address
        self.namespace = namespace
        self.block_nbytes = block_nbytes
        self._secret = secret
        # bounded in bytes: blocks copied out wait here for the thread that ships them
        self._queue: queue.Queue[tuple[int, bytes] | None] = queue.Queue(maxsize=max(1, queue_bytes // block_nbytes))
        self._put_timeout_s = put_timeout_s
        self._known: OrderedDict[int, None] = OrderedDict()  # hashes the store holds, or that are queued
        self._known_capacity = known_blocks
        self._known_lock = threading.Lock()
        self._counts = dict.fromkeys(("blocks_put", "blocks_dropped", "queue_full", "blocks_fetched", "errors"), 0)
        self._quiet_until = 0.0  # monotonic time before which no call is made
        self._closed = False
        self._async_channel: grpc.aio.Channel | None = None
        self._channel = grpc.insecure_channel(address, options=CHANNEL_OPTIONS)
        self._stub = kv_tier_pb2_grpc.KvTierStub(self._channel)
        self._thread = threading.Thread(target=self._ship_forever, name="kv-tier-put", daemon=True)
        self._thread.start()

    # ---- puts (any thread) ----------------------------------------------------------------------------

    def wants(self, block_hash: int) -> bool:
        """Whether a block is worth copying out for a put: not known to be held, not queued already."""
        with self._known_lock:
            return block_hash not in self._known

    def put(self, blocks: list[tuple[int, bytes]]) -> None:
        """Queues blocks (hash, bytes) for the store; never blocks (a full queue drops the rest)."""
        for block_hash, data in blocks:
            if not self.wants(block_hash):
                continue
            try:
                self._queue.put_nowait((block_hash, data))
            except queue.Full:
                self._count("blocks_dropped")
                self._count("queue_full")
                continue
            self._remember([block_hash])

    def _ship_forever(self) -> None:
        stopping = False
        while not stopping:
            batch: list[tuple[int, bytes]] = []
            item = self._queue.get()
            size = 0
            while True:
                if item is None:
                    stopping = True
                    self._queue.task_done()
                    break
                batch.append(item)
                size += len(item[1])
                if size >= MAX_PUT_BYTES:
                    break
                try:
                    item = self._queue.get_nowait()
                except queue.Empty:
                    break
            if batch:
                self._ship(batch)
                for _ in batch:
                    self._queue.task_done()

    def _ship(self, batch: list[tuple[int, bytes]]) -> None:
        if self._closed or time.monotonic() < self._quiet_until:
            self._forget_unsent(batch)
            return
        request = kv_tier_pb2.TierPutRequest(
            namespace=self.namespace,
            blocks=[kv_tier_pb2.TierBlock(block_hash=h, data=d, checksum=checksum(d)) for h, d in batch],
        )
        try:
            self._stub.Put(request, timeout=self._put_timeout_s, metadata=self._secret.metadata())
        except grpc.RpcError as error:
            self._failed("put blocks to", error)
            self._forget_unsent(batch)
            return
        self._count("blocks_put", len(batch))

    def _forget_unsent(self, batch: list[tuple[int, bytes]]) -> None:
        self._count("blocks_dropped", len(batch))
        with self._known_lock:
            for block_hash, _ in batch:
                self._known.pop(block_hash, None)

    def _remember(self, hashes: list[int]) -> None:
        with self._known_lock:
            for block_hash in hashes:
                self._known[block_hash] = None
                self._known.move_to_end(block_hash)
            while len(self._known) > self._known_capacity:
                self._known.popitem(last=False)

    # ---- fetches (the event loop) ---------------------------------------------------------------------

    async def fetch(self, hashes: list[int]) -> list[bytes]:
        """The bytes of the blocks of `hashes`, from the first, as long a run as the store holds intact;
        empty when the store cannot be asked."""
        if not hashes or time.monotonic() < self._quiet_until:
            return []
        stub = kv_tier_pb2_grpc.KvTierStub(self._aio_channel())
        fetched: list[bytes] = []
        while len(fetched) < len(hashes):
            parts = self._parts(hashes[len(fetched) :])
            try:
                replies = await asyncio.gather(*(self._get(stub, part) for part in parts))
            except grpc.aio.AioRpcError as error:
                self._failed("fetch blocks from", error)
                return []
            for part, reply in zip(parts, replies, strict=True):
                run = self._checked_run(reply.blocks, part)
                fetched.extend(run)
                if len(run) < len(part):  # a miss or a damaged block: the run ends here
                    self._count("blocks_fetched", len(fetched))
                    self._remember(hashes[: len(fetched)])
                    return fetched
        self._count("blocks_fetched", len(fetched))
        self._remember(hashes[: len(fetched)])
        return fetched

    def _parts(self, hashes: list[int]) -> list[list[int]]:
        """The keys split for Gets in parallel (one call's stream moves bytes at a fraction of what
        several do), each reply within MAX_GET_BYTES."""
        most = max(1, MAX_GET_BYTES // self.block_nbytes)
        size = min(most, max(MIN_PART_BLOCKS, -(-len(hashes) // PARALLEL_GETS)))
        return [hashes[start : start + size] for start in range(0, min(len(hashes), size * PARALLEL_GETS), size)]

    async def _get(self, stub: kv_tier_pb2_grpc.KvTierStub, hashes: list[int]) -> kv_tier_pb2.TierGetReply:
        keys = kv_tier_pb2.TierKeys(namespace=self.namespace, block_hashes=hashes)
        request = kv_tier_pb2.TierGetRequest(keys=keys, max_bytes=MAX_GET_BYTES)
        reply: kv_tier_pb2.TierGetReply = await stub.Get(request, timeout=FETCH_TIMEOUT_S)
        return reply

    async def lookup(self, hashes: list[int]) -> int:
        """How many of the blocks, from the first, the store holds (0 when it cannot be asked)."""
        stub = kv_tier_pb2_grpc.KvTierStub(self._aio_channel())
        try:
            reply = await stub.Lookup(
                kv_tier_pb2.TierKeys(namespace=self.namespace, block_hashes=hashes), timeout=FETCH_TIMEOUT_S
            )
        except grpc.aio.AioRpcError as error:
            self._failed("look blocks up in", error)
            return 0
        present: int = reply.present
        return present

    def _checked_run(self, blocks: Iterable[kv_tier_pb2.TierBlock], hashes: list[int]) -> list[bytes]:
        """The blocks that answer `hashes` in order, whole and matching their checksum, up to the first that
        does not."""
        run = []
        for block, expected in zip(blocks, hashes, strict=False):
            if block.block_hash != expected or len(block.data) != self.block_nbytes:
                self._count("errors")
                log.warning("the KV tier answered block %016x with a wrong key or length: ignored", expected)
                break
            if checksum(block.data) != block.checksum:
                self._count("errors")
                log.warning("the KV tier's block %016x failed its checksum on the way: ignored", expected)
                break
            run.append(block.data)
        return run

    def _aio_channel(self) -> grpc.aio.Channel:
        if self._async_channel is None:  # made on the loop that uses it
            self._async_channel = grpc.aio.insecure_channel(
                self.address, options=CHANNEL_OPTIONS, interceptors=attach_worker_secret(self._secret)
            )
        return self._async_channel

    # ---- the rest -------------------------------------------------------------------------------------

    def _failed(self, what: str, error: grpc.RpcError) -> None:
        self._count("errors")
        if time.monotonic() >= self._quiet_until:
            code = error.code().name if callable(getattr(error, "code", None)) else type(error).__name__
            log.warning("could not %s the KV tier at %s (%s); computing instead", what, self.address, code)
        self._quiet_until = time.monotonic() + RETRY_AFTER_S

    def _count(self, name: str, amount: int = 1) -> None:
        with self._known_lock:
            self._counts[name] += amount

    def stats(self) -> TierClientStats:
        with self._known_lock:
            return TierClientStats(**self._counts)

    async def flush(self, timeout: float = 5.0) -> bool:
        """Waits until every queued block was shipped or dropped (tests, benchmarks); False on timeout."""
        deadline = time.monotonic() + timeout
        while self._queue.unfinished_tasks and time.monotonic() < deadline:
            await asyncio.sleep(0.005)
        return not self._queue.unfinished_tasks

    async def close(self) -> None:
        """Stops the thread (blocks still queued are dropped: the tier is a cache) and the channels."""
        self._closed = True
        await asyncio.to_thread(self._queue.put, None)  # room comes as the thread drops what is queued
        await asyncio.to_thread(self._thread.join, self._put_timeout_s)
        self._channel.close()
        if self._async_channel is not None:
            await self._async_channel.close()
