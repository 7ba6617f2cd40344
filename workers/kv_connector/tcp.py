"""The TCP data path: a chunk's bytes follow its frame on the transfer's connection.

From a host-memory pool nothing is copied: the frame's bytes are gathered straight from the pool's
blocks with one `sendmsg` (unless the runner cannot show its blocks in place, `supports_block_views`:
a tensor-parallel runner's blocks are copied out as they are staged). Before a step may overwrite
blocks of a request that finished or was preempted, `wait_sent` waits for a chunk on the wire and copies
out one not sent yet, so a slow decode worker never holds the prefill engine up. From a GPU pool, chunks
are copied to pinned host memory first.
"""

import socket

import xxhash
from typing_extensions import override

from workers.kv_connector.paths import BufferedSendPath, FromPoolSendPath, PoolChunk, ReceivePath, StagedChunk
from workers.kv_connector.staging import StagingPool
from workers.kv_connector.wire import checksum, chunk_frame, recv_into, sendmsg_all
from workers.runner.kv_pool import KvLayout


class TcpFromPool(FromPoolSendPath):
    data_path = "tcp"

    def send(self, sock: socket.socket, chunk: StagedChunk) -> None:
        assert isinstance(chunk, PoolChunk)
        with chunk.lock:
            digest = xxhash.xxh3_64()
            for part in chunk.views:
                digest.update(part)
            sock.sendall(chunk_frame(chunk.first_block, chunk.count, 0, digest.intdigest()))
            sendmsg_all(sock, chunk.views)
            self.sent(chunk)

    def _copy_out(self, chunk: PoolChunk, data: bytes | memoryview) -> None:
        chunk.views = [memoryview(bytes(data))]
        chunk.in_pool = False


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
    @override
    def read(self, conn: socket.socket, target: memoryview, offset: int, what: str) -> None:
        recv_into(conn, target, what)
