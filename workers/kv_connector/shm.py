"""The shared-memory data path, for a prefill and a decode worker on one host: the forward thread copies
each chunk into a reusable segment under /dev/shm, and the frame on the connection tells the receiver
where it lies.

The decode worker writes a probe file holding a random nonce and its host id
(`workers.kv_connector.host_identity`); a sender that reads both back shares its /dev/shm and is on its
host. Seeing the file is not enough: two network namespaces of one machine share /dev/shm, yet each is a
host of its own unless the operator gives them one host id.

Files are named /dev/shm/diptych-kv-<pid>-...: a worker removes its own when it stops, and at start
removes those of processes that no longer run.
"""

import contextlib
import hmac
import mmap
import os
import secrets
import socket
import threading
from collections import OrderedDict
from dataclasses import dataclass

import grpc
import torch
from typing_extensions import override

from diptych_common.processes import process_alive
from workers.kv_connector.paths import BufferedSendPath, ReceivePath, StagedChunk
from workers.kv_connector.staging import buffer_size
from workers.kv_connector.wire import KvTransferError, checksum, chunk_frame
from workers.runner.kv_pool import KvLayout

SHM_DIR = "/dev/shm"
SHM_PREFIX = "diptych-kv-"


@dataclass(eq=False)
class Segment:
    name: str
    size: int
    mapping: mmap.mmap
    tensor: torch.Tensor


class SharedSegments:
    """The sender's shared-memory segments, reused across transfers (created once, pre-touched)."""

    def __init__(self, keep_bytes: int = 1 << 30) -> None:
        self._keep_bytes = keep_bytes  # idle segments beyond this are removed, smallest first
        self._idle: list[Segment] = []
        self._all: list[Segment] = []
        self._lock = threading.Lock()
        self._counter = 0

    def acquire(self, nbytes: int) -> Segment:
        with self._lock:
            fitting = [s for s in self._idle if s.size >= nbytes]
            if fitting:
                segment = min(fitting, key=lambda s: s.size)
                self._idle.remove(segment)
                return segment
            self._counter += 1
            name = f"{SHM_PREFIX}{os.getpid()}-{self._counter}-{secrets.token_hex(4)}"
        size = buffer_size(nbytes)
        fd = os.open(os.path.join(SHM_DIR, name), os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
        try:
            os.ftruncate(fd, size)
            mapping = mmap.mmap(fd, size)
        finally:
            os.close(fd)
        tensor = torch.frombuffer(mapping, dtype=torch.uint8)
        tensor.fill_(0)
        segment = Segment(name, size, mapping, tensor)
        with self._lock:
            self._all.append(segment)
        return segment

    def release(self, segment: Segment) -> None:
        with self._lock:
            self._idle.append(segment)
            while sum(s.size for s in self._idle) > self._keep_bytes:
                smallest = min(self._idle, key=lambda s: s.size)
                self._idle.remove(smallest)
                self._all.remove(smallest)
                remove_file(smallest.name)

    def close(self) -> None:
        with self._lock:
            for segment in self._all:
                remove_file(segment.name)
            self._all, self._idle = [], []


class ShmSend(BufferedSendPath):
    data_path = "shm"

    def __init__(self, segments: SharedSegments, layout: KvLayout, nbytes: int) -> None:
        self._segments = segments
        self._segment = segments.acquire(nbytes)
        self.segment = self._segment.name
        super().__init__(self._segment.tensor, layout)

    def _deliver(self, sock: socket.socket, chunk: StagedChunk, start: int, data: memoryview) -> None:
        sock.sendall(chunk_frame(chunk.first_block, chunk.count, start, checksum(data)))  # the bytes are there

    def _give_back(self) -> None:
        self._segments.release(self._segment)


class ShmReceive(ReceivePath):
    def __init__(self, segment: memoryview) -> None:
        self._segment = segment

    @override
    def read(self, conn: socket.socket, target: memoryview, offset: int, what: str) -> None:
        if offset + len(target) > len(self._segment):
            raise KvTransferError(grpc.StatusCode.INVALID_ARGUMENT, "a KV frame points past its segment")
        target[:] = self._segment[offset : offset + len(target)]


class SegmentReader:
    """The receiver's read-only mappings of senders' segments, kept for reuse."""

    def __init__(self, keep: int = 64) -> None:
        self._maps: OrderedDict[str, mmap.mmap] = OrderedDict()
        self._keep = keep
        self._lock = threading.Lock()

    def view(self, name: str) -> memoryview:
        if not name.startswith(SHM_PREFIX) or "/" in name or name in (".", ".."):
            raise KvTransferError(grpc.StatusCode.INVALID_ARGUMENT, f"{name!r} is not a KV segment name")
        with self._lock:
            mapping = self._maps.get(name)
            if mapping is None:
                try:
                    fd = os.open(os.path.join(SHM_DIR, name), os.O_RDONLY)
                except OSError as error:
                    raise KvTransferError(
                        grpc.StatusCode.FAILED_PRECONDITION, f"cannot open the KV segment {name}: {error}"
                    ) from None
                try:
                    mapping = mmap.mmap(fd, 0, prot=mmap.PROT_READ)
                finally:
                    os.close(fd)
                self._maps[name] = mapping
                while len(self._maps) > self._keep:
                    _close(self._maps.popitem(last=False)[1])
            self._maps.move_to_end(name)
            return memoryview(mapping)

    def close(self) -> None:
        with self._lock:
            for mapping in self._maps.values():
                _close(mapping)
            self._maps.clear()


def _close(mapping: mmap.mmap) -> None:
    """Unmaps now, or, while a transfer still reads through a view of it, when that view goes."""
    with contextlib.suppress(BufferError):
        mapping.close()


# ---- the probe: whether a sender shares this host's /dev/shm ------------------------------------------


def make_probe(host_id: str) -> tuple[str, bytes]:
    """Writes a file only a process on this host (same /dev/shm) can read back, holding a fresh nonce and
    `host_id`; returns its name and nonce, or ("", b"") where there is no /dev/shm."""
    if not os.path.isdir(SHM_DIR):
        return "", b""
    name = f"{SHM_PREFIX}probe-{os.getpid()}-{secrets.token_hex(8)}"
    nonce = secrets.token_bytes(16)
    with open(os.path.join(SHM_DIR, name), "xb") as probe:
        probe.write(nonce + host_id.encode())
    return name, nonce


def probe_matches(name: str, nonce: bytes, host_id: str) -> bool:
    """Whether the peer's probe file is readable here and holds its nonce and our host id (then both
    share /dev/shm and the operator counts them as one host)."""
    if not name.startswith(SHM_PREFIX) or "/" in name:
        return False
    expected = nonce + host_id.encode()
    try:
        with open(os.path.join(SHM_DIR, name), "rb") as probe:
            return hmac.compare_digest(probe.read(len(expected) + 1), expected)
    except OSError:
        return False


def sweep_stale_files() -> int:
    """Removes this module's files in /dev/shm left by processes that no longer run (a worker killed
    before it could clean up); their names carry the owner's pid. Returns how many were removed."""
    removed = 0
    try:
        names = os.listdir(SHM_DIR)
    except OSError:
        return 0
    for name in names:
        if not name.startswith(SHM_PREFIX):
            continue
        owner = name.removeprefix(SHM_PREFIX).removeprefix("probe-").split("-", 1)[0]
        if not owner.isdigit() or process_alive(int(owner)):
            continue
        try:
            os.unlink(os.path.join(SHM_DIR, name))
            removed += 1
        except OSError:
            pass
    return removed


def remove_file(name: str) -> None:
    """Removes a file's name; a segment's memory goes once every mapping of it is closed."""
    with contextlib.suppress(FileNotFoundError):
        os.unlink(os.path.join(SHM_DIR, name))
