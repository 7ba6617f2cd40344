"""A data path: how a transfer's chunks of KV blocks leave the sender's pool and reach the receiver's
buffer. TCP (`workers.kv_connector.tcp`) and shared memory (`workers.kv_connector.shm`) implement it; a
transfer picks one per peer, and frames, checksums and the protocol around them stay the same."""

import socket
import threading
from abc import ABC, abstractmethod
from dataclasses import dataclass, field

import torch

from workers.runner.kv_pool import BlocksRead, KvLayout, KvSource


class BytesByPath:
    """KV bytes of the transfers that ended whole, by data path; added to on transfer threads."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._counts: dict[str, int] = {}

    def add(self, data_path: str, nbytes: int) -> None:
        with self._lock:
            self._counts[data_path] = self._counts.get(data_path, 0) + nbytes

    def snapshot(self) -> dict[str, int]:
        with self._lock:
            return dict(self._counts)

    @property
    def total(self) -> int:
        return sum(self.snapshot().values())


@dataclass(eq=False)
class StagedChunk:
    """Blocks first_block.. first_block + count - 1 of a request's KV, staged and waiting to be sent."""

    first_block: int
    count: int
    read: BlocksRead | None = None  # the copy out of the pool, where it may still be under way


class SendPath(ABC):
    """The sending half. `stage` runs on the engine's forward thread, where the pool is consistent; `send`
    on the transfer's own thread, chunk after chunk; `wait_sent` on the forward thread before a step may
    overwrite blocks already staged; `release` once, when the transfer ends."""

    data_path: str  # its name in the hello
    segment: str = ""  # the shared-memory segment the receiver reads chunks from, if any

    @abstractmethod
    def stage(self, runner: KvSource, block_ids: list[int], first_block: int) -> StagedChunk | None:
        """Stages computed blocks; None when the transfer was already released."""

    def after_hello(self, sock: socket.socket, first_block: int) -> None:
        """Reads what the receiver says of this path once the hello is answered and the first block sent
        is fixed (NIXL: where to write); others read nothing."""
        return None

    @abstractmethod
    def send(self, sock: socket.socket, chunk: StagedChunk) -> None:
        """Sends the chunk's frame (and, on a socket path, its bytes)."""

    @abstractmethod
    def wait_sent(self) -> None:
        """Makes sure no chunk still to be sent reads the pool (only a path that sends from it must wait)."""

    @abstractmethod
    def release(self) -> None:
        """Gives back what the transfer held; later stages do nothing."""


class ReceivePath(ABC):
    """The receiving half: fills a chunk's place in the receive buffer."""

    def wait_frame(self, conn: socket.socket) -> None:
        """Called before each frame is read; a path whose bytes move outside the connection may have to
        drive them meanwhile (NIXL); the others return at once."""
        return None

    @abstractmethod
    def read(self, conn: socket.socket, target: memoryview, offset: int, what: str) -> None: ...


@dataclass(eq=False)
class PoolChunk(StagedChunk):
    """A chunk as views into the KV pool, until it is sent or copied out of it."""

    views: list[memoryview] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)  # held while it is sent or copied out
    in_pool: bool = True  # its views point into the pool; false once sent, copied out, or dropped
    buffer: torch.Tensor | None = None  # where a path that copies into a buffer of its own put the copy


class FromPoolSendPath(SendPath):
    """Chunks sent straight out of a host-memory pool (a pool that cannot be seen in place,
    `supports_block_views` false, is copied out as it is staged). Before a step may overwrite blocks of a
    request that finished or was preempted, `wait_sent` waits for a chunk being sent and copies out one
    not sent yet, so a slow receiver never holds the prefill engine up. A subclass sends a chunk holding its
    lock and ends with `sent`."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._released = False
        self._in_pool: list[PoolChunk] = []  # chunks that may still read the pool

    def stage(self, runner: KvSource, block_ids: list[int], first_block: int) -> StagedChunk | None:
        chunk = PoolChunk(first_block, len(block_ids))
        if runner.supports_block_views:
            chunk.views = self._views_of(runner, block_ids)
        else:
            self._copy_out(chunk, copied_blocks(runner, block_ids))
        with self._lock:
            if self._released:
                self._drop(chunk)
                return None
            self._in_pool = [c for c in self._in_pool if c.in_pool] + [chunk]
        return chunk

    def wait_sent(self) -> None:
        with self._lock:
            chunks = list(self._in_pool)
        for chunk in chunks:
            with chunk.lock:
                if chunk.in_pool:
                    self._copy_out(chunk, b"".join(chunk.views))

    def release(self) -> None:
        with self._lock:
            if self._released:
                return
            self._released = True
            chunks, self._in_pool = self._in_pool, []
        for chunk in chunks:  # never to be sent: they no longer hold on to the pool
            with chunk.lock:
                self._drop(chunk)

    def sent(self, chunk: PoolChunk) -> None:
        """The chunk left (called holding its lock)."""
        self._drop(chunk)

    def _views_of(self, runner: KvSource, block_ids: list[int]) -> list[memoryview]:
        return runner.block_views(block_ids)

    @abstractmethod
    def _copy_out(self, chunk: PoolChunk, data: bytes | memoryview) -> None:
        """Makes the chunk's views a copy of `data` outside the pool (called holding its lock, or before it
        is shared) and sets in_pool false."""

    def _drop(self, chunk: PoolChunk) -> None:
        """The chunk is sent or never will be: what it holds goes back (called holding its lock)."""
        chunk.in_pool = False


class BufferedSendPath(SendPath):
    """Chunks copied out of the pool into a host buffer of the transfer's own (pinned staging memory or a
    shared-memory segment), at the chunk's place in the request's KV."""

    def __init__(self, buffer: torch.Tensor, layout: KvLayout) -> None:
        self._buffer = buffer
        self._bytes = buffer.numpy().data
        self._layout = layout
        self._lock = threading.Lock()
        self._released = False
        self._reads: list[BlocksRead] = []  # copies into the buffer, which may not be given back under way

    def stage(self, runner: KvSource, block_ids: list[int], first_block: int) -> StagedChunk | None:
        out = blocks_in(self._buffer, self._layout, first_block, len(block_ids))
        with self._lock:  # the buffer may not be given back while the forward thread fills it
            if self._released:
                return None
            read = runner.start_reading_blocks(block_ids, out)
            self._reads.append(read)
        return StagedChunk(first_block, len(block_ids), read)

    def send(self, sock: socket.socket, chunk: StagedChunk) -> None:
        if chunk.read is not None:
            chunk.read.wait()
        start, size = chunk.first_block * self._layout.block_nbytes, chunk.count * self._layout.block_nbytes
        self._deliver(sock, chunk, start, self._bytes[start : start + size])

    def wait_sent(self) -> None:
        pass  # chunks left the pool when they were staged

    @abstractmethod
    def _deliver(self, sock: socket.socket, chunk: StagedChunk, start: int, data: memoryview) -> None:
        """Gets the chunk's bytes (at `start` of the buffer) to the receiver, and sends its frame."""

    def release(self) -> None:
        with self._lock:
            if self._released:
                return
            self._released = True
            reads, self._reads = self._reads, []
        for read in reads:
            read.wait()
        self._give_back()

    @abstractmethod
    def _give_back(self) -> None: ...


def copied_blocks(runner: KvSource, block_ids: list[int]) -> memoryview:
    """The blocks' bytes copied out of the runner's pool, in `read_blocks`'s order: for a runner whose pool
    cannot be seen in place (`supports_block_views` false: a tensor-parallel runner's heads are spread over
    processes)."""
    layout = runner.layout
    buffer = torch.empty(len(block_ids) * layout.block_nbytes, dtype=torch.uint8)
    runner.read_blocks(block_ids, blocks_in(buffer, layout, 0, len(block_ids)))
    return buffer.numpy().data


def blocks_in(buffer: torch.Tensor, layout: KvLayout, first_block: int, count: int) -> torch.Tensor:
    """The place of blocks first_block.. in a byte buffer holding a request's KV chunk after chunk, as a
    tensor [layers, 2, count, block_size, kv_heads, head_dim]."""
    start, size = first_block * layout.block_nbytes, count * layout.block_nbytes
    return (
        buffer[start : start + size]
        .view(layout.dtype)
        .view(layout.num_layers, 2, count, layout.block_size, layout.kv_heads, layout.head_dim)
    )
