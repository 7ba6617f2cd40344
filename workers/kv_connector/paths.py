"""A data path: how a transfer's chunks of KV blocks leave the sender's pool and reach the receiver's
buffer. TCP (`workers.kv_connector.tcp`) and shared memory (`workers.kv_connector.shm`) implement it; a
transfer picks one per peer, and frames, checksums and the protocol around them stay the same."""

import socket
import threading
from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch

from workers.kv_pool import KvLayout, KvSource


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


class BufferedSendPath(SendPath):
    """Chunks copied out of the pool into a host buffer of the transfer's own (pinned staging memory or a
    shared-memory segment), at the chunk's place in the request's KV."""

    def __init__(self, buffer: torch.Tensor, layout: KvLayout) -> None:
        self._buffer = buffer
        self._bytes = buffer.numpy().data
        self._layout = layout
        self._lock = threading.Lock()
        self._released = False

    def stage(self, runner: KvSource, block_ids: list[int], first_block: int) -> StagedChunk | None:
        out = blocks_in(self._buffer, self._layout, first_block, len(block_ids))
        with self._lock:  # the buffer may not be given back while the forward thread fills it
            if self._released:
                return None
            runner.read_blocks(block_ids, out)
        return StagedChunk(first_block, len(block_ids))

    def send(self, sock: socket.socket, chunk: StagedChunk) -> None:
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
