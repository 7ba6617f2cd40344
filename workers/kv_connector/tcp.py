"""The TCP data path: a chunk's bytes follow its frame on the transfer's connection.

From a host-memory pool nothing is copied: the frame's bytes are gathered straight from the pool's
blocks with one `sendmsg` (unless the runner cannot show its blocks in place, `supports_block_views`:
a tensor-parallel runner's blocks are copied out as they are staged). Before a step may overwrite
blocks of a request that finished or was preempted, `wait_sent` waits for a chunk on the wire and copies
out one not sent yet, so a slow decode worker never holds the prefill engine up. From a GPU pool, chunks
are copied to pinned host memory first.
"""

import socket
import threading
from dataclasses import dataclass, field

import xxhash

from workers.kv_connector.paths import BufferedSendPath, ReceivePath, SendPath, StagedChunk, copied_blocks
from workers.kv_connector.staging import StagingPool
from workers.kv_connector.wire import checksum, chunk_frame, recv_into, sendmsg_all
from workers.kv_pool import KvLayout, KvSource


@dataclass(eq=False)
class PoolChunk(StagedChunk):
    """A chunk as views into the KV pool, until it is sent or copied out."""

    views: list[memoryview] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)
    done: bool = False  # sent, copied out of the pool, or dropped


class TcpFromPool(SendPath):
    data_path = "tcp"

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._released = False
        self._in_pool: list[PoolChunk] = []  # chunks that may still read the pool

    def stage(self, runner: KvSource, block_ids: list[int], first_block: int) -> StagedChunk | None:
        if runner.supports_block_views:
            chunk = PoolChunk(first_block, len(block_ids), runner.block_views(block_ids))
        else:  # copied out now: no longer in the pool
            chunk = PoolChunk(first_block, len(block_ids), [copied_blocks(runner, block_ids)], done=True)
        with self._lock:
            if self._released:
                return None
            self._in_pool = [c for c in self._in_pool if not c.done] + [chunk]
        return chunk

    def send(self, sock: socket.socket, chunk: StagedChunk) -> None:
        assert isinstance(chunk, PoolChunk)
        with chunk.lock:
            digest = xxhash.xxh3_64()
            for part in chunk.views:
                digest.update(part)
            sock.sendall(chunk_frame(chunk.first_block, chunk.count, 0, digest.intdigest()))
            sendmsg_all(sock, chunk.views)
            chunk.done = True

    def wait_sent(self) -> None:
        with self._lock:
            chunks = list(self._in_pool)
        for chunk in chunks:
            with chunk.lock:  # held while the chunk is on the wire
                if not chunk.done:
                    chunk.views = [memoryview(bytes(view)) for view in chunk.views]
                    chunk.done = True  # no longer in the pool; still to be sent

    def release(self) -> None:
        with self._lock:
            if self._released:
                return
            self._released = True
            chunks, self._in_pool = self._in_pool, []
        for chunk in chunks:  # never to be sent: they no longer hold on to the pool
            with chunk.lock:
                chunk.done = True


class TcpFromBuffer(BufferedSendPath):
    data_path = "tcp"

    def __init__(self, staging: StagingPool, layout: KvLayout, nbytes: int) -> None:
        self._staging = staging
        super().__init__(staging.acquire(nbytes), layout)

    def _deliver(self, sock: socket.socket, chunk: StagedChunk, start: int, data: memoryview) -> None:
        sock.sendall(chunk_frame(chunk.first_block, chunk.count, start, checksum(data)))
        sock.sendall(data)

    def _give_back(self) -> None:
        self._staging.release(self._buffer)


class TcpReceive(ReceivePath):
    def read(self, conn: socket.socket, target: memoryview, offset: int, what: str) -> None:
        recv_into(conn, target, what)
