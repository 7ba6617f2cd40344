"""The KV data path: a prefill worker streams a request's KV blocks to a decode worker while it computes.

gRPC carries only control (GetKvEndpoint). The bytes go over one raw TCP connection per transfer, or,
when both workers share a host, through shared memory: the sender stages each chunk in a segment under
/dev/shm and the TCP connection carries only the frames that say where the chunk lies.

On the wire (little-endian):
  sender → receiver  HELLO: b"DKV2", u32 length (at most MAX_HELLO_BYTES), JSON header (request id,
                     transfer token, KV layout, number of tokens, data path, shared-memory segment name)
  receiver → sender  REPLY: u32 length, JSON {"ok": true} or {"ok": false, "code", "error"}
  sender → receiver  the prompt's token ids, number of tokens × u32
  sender → receiver  frames: FRAME struct (kind, first block, block count, offset, xxh3-64 checksum),
                     followed, on the TCP path, by the chunk's bytes; kind b"K" keeps an idle connection
                     alive, b"X" aborts with a reason, b"E" ends with the first token id (in `first_block`)
  receiver → sender  REPLY once the whole cache is in and checked.

The receiver hands a cache over only when every block arrived and every checksum matched, so a half-
received cache is never decoded. Both sides time out after `io_timeout` seconds without progress.

Nothing is allocated for a peer before it proved it may send: the hello is small and bounded and must
arrive within `hello_timeout`; the transfer token is checked, and the declared size against what the
waiting decode request needs and the KV pool holds, before the prompt is read or a buffer is taken; and
the number of open data connections is bounded (one thread each), beyond which connections are refused.
"""

import hmac
import json
import logging
import mmap
import os
import queue
import secrets
import socket
import struct
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field

import grpc
import torch
import xxhash

from workers.model_runner import KvLayout

log = logging.getLogger(__name__)

MAGIC = b"DKV2"
FRAME = struct.Struct("<cxxxIIQQ")  # kind, first block, block count, offset, checksum
SHM_DIR = "/dev/shm"
SHM_PREFIX = "diptych-kv-"
MAX_HELLO_BYTES = 4 << 10  # the hello carries no prompt: a few hundred bytes
MAX_REPLY_BYTES = 64 << 10  # replies and abort reasons: a sentence
MAX_DATA_CONNECTIONS = 256
TOKEN_ID = struct.Struct("<I")
SOCKET_BUFFER_BYTES = 4 << 20  # larger kernel buffers: fewer, longer system calls per chunk
_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def checksum(data) -> int:
    return xxhash.xxh3_64_intdigest(data)


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


class KvTransferError(Exception):
    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(message)
        self.code = code


# ---- buffers ------------------------------------------------------------------------------------

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
        if not owner.isdigit() or _alive(int(owner)):
            continue
        try:
            os.unlink(os.path.join(SHM_DIR, name))
            removed += 1
        except OSError:
            pass
    return removed


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


class StagingPool:
    """Reusable host buffers. A fresh buffer's first touch costs far more than copying into a warm one,
    so buffers are kept (up to `keep_bytes` of idle ones) and handed out again; pinned on CUDA hosts so
    copies to and from the GPU run asynchronously."""

    def __init__(self, pin: bool = False, keep_bytes: int = 1 << 30) -> None:
        self._pin = pin
        self._keep_bytes = keep_bytes
        self._idle: list[torch.Tensor] = []
        self._lock = threading.Lock()

    def acquire(self, nbytes: int) -> torch.Tensor:
        with self._lock:
            fitting = [i for i, b in enumerate(self._idle) if b.numel() >= nbytes]
            if fitting:  # (by position: tensors compare element-wise, so list.remove would not do)
                return self._idle.pop(min(fitting, key=lambda i: self._idle[i].numel()))
        size = max(1 << 20, 1 << (max(nbytes, 1) - 1).bit_length())
        buffer = torch.empty(size, dtype=torch.uint8, pin_memory=self._pin)
        buffer.fill_(0)
        return buffer

    def release(self, buffer: torch.Tensor) -> None:
        with self._lock:
            self._idle.append(buffer)
            while sum(b.numel() for b in self._idle) > self._keep_bytes:
                self._idle.pop(min(range(len(self._idle)), key=lambda i: self._idle[i].numel()))


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
        size = max(1 << 20, 1 << (max(nbytes, 1) - 1).bit_length())
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
                _unlink(smallest)

    def close(self) -> None:
        with self._lock:
            for segment in self._all:
                _unlink(segment)
            self._all, self._idle = [], []


def _unlink(segment: Segment) -> None:
    """Removes the segment's name; its memory goes once every mapping of it is closed."""
    try:
        os.unlink(os.path.join(SHM_DIR, segment.name))
    except FileNotFoundError:
        pass


class _SegmentReader:
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
                    self._maps.popitem(last=False)[1].close()
            self._maps.move_to_end(name)
            return memoryview(mapping)

    def close(self) -> None:
        with self._lock:
            for mapping in self._maps.values():
                mapping.close()
            self._maps.clear()


# ---- socket helpers -----------------------------------------------------------------------------

def _recv_into(sock: socket.socket, view: memoryview, what: str, deadline: float | None = None) -> None:
    """Fills `view`; by `deadline` (time.monotonic()) in all when given, so a trickle cannot hold on."""
    received = 0
    while received < len(view):
        try:
            if deadline is not None:
                sock.settimeout(_until(deadline))
            count = sock.recv_into(view[received:])
        except TimeoutError:
            raise KvTransferError(
                grpc.StatusCode.DEADLINE_EXCEEDED, f"the KV transfer stalled while receiving {what}"
            ) from None
        if count == 0:
            raise KvTransferError(
                grpc.StatusCode.DATA_LOSS,
                f"the KV stream was cut off while receiving {what} ({received} of {len(view)} bytes)",
            )
        received += count


def _until(deadline: float) -> float:
    remaining = deadline - time.monotonic()
    if remaining <= 0:
        raise TimeoutError
    return remaining


def _recv_exact(sock: socket.socket, nbytes: int, what: str, deadline: float | None = None) -> bytes:
    buffer = bytearray(nbytes)
    _recv_into(sock, memoryview(buffer), what, deadline)
    return bytes(buffer)


def _sendmsg_all(sock: socket.socket, views: list[memoryview]) -> None:
    """Sends every view, in order, with as few system calls as the kernel allows (scatter-gather)."""
    views = [view for view in views if len(view)]
    while views:
        sent = sock.sendmsg(views[:512])
        while sent:
            if sent >= len(views[0]):
                sent -= len(views.pop(0))
            else:
                views[0], sent = views[0][sent:], 0


def _tune(sock: socket.socket) -> None:
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, SOCKET_BUFFER_BYTES)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, SOCKET_BUFFER_BYTES)


def _send_json(sock: socket.socket, message: dict) -> None:
    body = json.dumps(message).encode()
    sock.sendall(struct.pack("<I", len(body)) + body)


def _recv_json(sock: socket.socket, what: str, limit: int = MAX_REPLY_BYTES, deadline: float | None = None) -> dict:
    (length,) = struct.unpack("<I", _recv_exact(sock, 4, what, deadline))
    if length > limit:
        raise KvTransferError(
            grpc.StatusCode.INVALID_ARGUMENT, f"the {what} is too large ({length} bytes; at most {limit})"
        )
    try:
        message = json.loads(_recv_exact(sock, length, what, deadline))
    except ValueError:
        raise KvTransferError(grpc.StatusCode.INVALID_ARGUMENT, f"the {what} is not valid JSON") from None
    if not isinstance(message, dict):
        raise KvTransferError(grpc.StatusCode.INVALID_ARGUMENT, f"the {what} is not a JSON object")
    return message


def _reply_after_close(sock: socket.socket) -> dict:
    """The receiver's last word after it broke the connection, when it left one."""
    try:
        return _recv_json(sock, "the decode worker's reason for closing")
    except (KvTransferError, OSError):
        return {"ok": True}


def _check_reply(reply: dict) -> None:
    if not reply.get("ok"):
        code = getattr(grpc.StatusCode, str(reply.get("code")), grpc.StatusCode.UNKNOWN)
        raise KvTransferError(code, f"the decode worker refused the KV cache: {reply.get('error')}")


# ---- receiving side -----------------------------------------------------------------------------

@dataclass
class ReceivedKv:
    prompt_token_ids: list[int]
    first_token_id: int
    num_tokens: int
    chunks: list  # (first block, tensor [layers, 2, blocks, block_size, kv_heads, head_dim])
    nbytes: int  # whole blocks, the last one partly filled: what moved
    data_path: str
    release: Callable[[], None]


@dataclass
class _Slot:
    transfer_token: bytes
    deliver: Callable[[object], None]  # called with a ReceivedKv or a KvTransferError, once
    max_tokens: int  # the prompt length the decode request declared: no larger cache is accepted
    claimed: bool = False


class KvInbox:
    """Where decode requests wait for their KV. Thread-safe: transfers arrive on receiver threads.
    A transfer may arrive before its request registers; it then waits up to `arrival_timeout`."""

    def __init__(self, arrival_timeout: float = 5.0) -> None:
        self._arrival_timeout = arrival_timeout
        self._slots: dict[str, _Slot] = {}
        self._changed = threading.Condition()

    def expect(
        self, request_id: str, transfer_token: bytes, deliver: Callable[[object], None], max_tokens: int
    ) -> None:
        with self._changed:
            if request_id in self._slots:
                raise KvTransferError(grpc.StatusCode.ALREADY_EXISTS, f"request {request_id} already waits for KV")
            self._slots[request_id] = _Slot(transfer_token, deliver, max_tokens)
            self._changed.notify_all()

    def forget(self, request_id: str) -> None:
        with self._changed:
            self._slots.pop(request_id, None)

    def claim(self, request_id: str, transfer_token: bytes) -> _Slot:
        deadline = time.monotonic() + self._arrival_timeout
        with self._changed:
            while (slot := self._slots.get(request_id)) is None:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise KvTransferError(
                        grpc.StatusCode.FAILED_PRECONDITION,
                        f"no decode request for {request_id} is waiting for its KV cache",
                    )
                self._changed.wait(remaining)
            if not hmac.compare_digest(slot.transfer_token, transfer_token):
                raise KvTransferError(grpc.StatusCode.PERMISSION_DENIED, "the KV transfer token does not match")
            if slot.claimed:
                raise KvTransferError(
                    grpc.StatusCode.PERMISSION_DENIED, f"the KV cache of {request_id} was already sent"
                )
            slot.claimed = True
            return slot


class KvReceiver:
    """The decode worker's data port: one thread per incoming transfer (at most `max_connections`),
    reading into warm buffers. `max_tokens` is what the KV pool holds: no larger cache is accepted."""

    def __init__(
        self, inbox: KvInbox, layout: KvLayout, host: str = "127.0.0.1", port: int = 0,
        io_timeout: float = 5.0, staging: StagingPool | None = None, max_tokens: int | None = None,
        max_connections: int = MAX_DATA_CONNECTIONS, hello_timeout: float = 5.0,
    ) -> None:
        self.inbox = inbox
        self.layout = layout
        self.io_timeout = io_timeout
        self.hello_timeout = hello_timeout  # the whole hello must arrive within it
        self.max_tokens = max_tokens
        self.staging = staging or StagingPool()
        self._connections = threading.BoundedSemaphore(max_connections)
        self.connections_refused = 0
        self._segments = _SegmentReader()
        self._listener = socket.create_server((host, port), backlog=128)
        self.host, self.port = self._listener.getsockname()[:2]
        self.bytes_received = 0
        self.shm_probe_name = ""
        self.shm_probe_nonce = b""
        self._closed = False
        self._thread = threading.Thread(target=self._accept_forever, name="kv-receiver", daemon=True)

    def start(self) -> None:
        self._make_probe()
        self._thread.start()

    def close(self) -> None:
        self._closed = True
        try:
            self._listener.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self._listener.close()
        if self.shm_probe_name:
            try:
                os.unlink(os.path.join(SHM_DIR, self.shm_probe_name))
            except FileNotFoundError:
                pass
        self._segments.close()

    def _make_probe(self) -> None:
        """A file only a process on this host (same /dev/shm) can read back: how senders learn that
        shared memory reaches this worker."""
        if not os.path.isdir(SHM_DIR):
            return
        name = f"{SHM_PREFIX}probe-{os.getpid()}-{secrets.token_hex(8)}"
        nonce = secrets.token_bytes(16)
        with open(os.path.join(SHM_DIR, name), "xb") as probe:
            probe.write(nonce)
        self.shm_probe_name, self.shm_probe_nonce = name, nonce

    def _accept_forever(self) -> None:
        while not self._closed:
            try:
                conn, _ = self._listener.accept()
            except OSError:
                return
            if not self._connections.acquire(blocking=False):
                self._refuse(conn)
                continue
            threading.Thread(target=self._serve, args=(conn,), name="kv-receive", daemon=True).start()

    def _refuse(self, conn: socket.socket) -> None:
        self.connections_refused += 1
        with conn:
            conn.setblocking(False)  # a peer that reads nothing cannot hold up the accept loop
            _try_send_json(conn, {
                "ok": False, "code": "RESOURCE_EXHAUSTED",
                "error": "this decode worker has as many KV connections open as it serves; retry shortly",
            })

    def _serve(self, conn: socket.socket) -> None:
        try:
            self._serve_connection(conn)
        finally:
            self._connections.release()

    def _serve_connection(self, conn: socket.socket) -> None:
        slot = None
        try:
            with conn:
                _tune(conn)
                try:
                    header = self._read_hello(conn)
                    conn.settimeout(self.io_timeout)
                    slot = self.inbox.claim(header["request_id"], bytes.fromhex(header["transfer_token"]))
                    self._check_size(int(header["num_tokens"]), slot)
                    _send_json(conn, {"ok": True})
                    received = self._read_cache(conn, header)
                except KvTransferError as error:
                    if slot is not None:
                        slot.deliver(error)
                    _try_send_json(conn, {"ok": False, "code": error.code.name, "error": str(error)})
                    return
                self.bytes_received += received.nbytes
                slot.deliver(received)
                _try_send_json(conn, {"ok": True, "bytes": received.nbytes})
        except Exception as error:  # never let a bad peer kill the thread silently
            log.exception("KV receive failed")
            if slot is not None:
                slot.deliver(KvTransferError(grpc.StatusCode.INTERNAL, f"the KV receive failed: {error}"))

    def _read_hello(self, conn: socket.socket) -> dict:
        deadline = time.monotonic() + self.hello_timeout
        if _recv_exact(conn, 4, "the KV hello", deadline) != MAGIC:
            raise KvTransferError(
                grpc.StatusCode.INVALID_ARGUMENT, f"this is not a Diptych KV stream of this version (it starts with {MAGIC!r})"
            )
        header = _recv_json(conn, "the KV header", MAX_HELLO_BYTES, deadline)
        lay = self.layout
        expected = [lay.num_layers, lay.kv_heads, lay.head_dim, lay.block_size, dtype_name(lay.dtype)]
        try:
            got = [header["num_layers"], header["kv_heads"], header["head_dim"], header["block_size"], header["dtype"]]
            int(header["num_tokens"]), bytes.fromhex(header["transfer_token"]), str(header["request_id"])
        except (KeyError, TypeError, ValueError):
            raise KvTransferError(grpc.StatusCode.INVALID_ARGUMENT, "the KV header is incomplete") from None
        if got != expected:
            raise KvTransferError(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"the KV layout (layers, kv heads, head dim, block size, dtype) {got} does not match this "
                f"worker's {expected}: both workers must serve the same model with the same block size",
            )
        if header.get("data_path") not in ("tcp", "shm"):
            raise KvTransferError(grpc.StatusCode.INVALID_ARGUMENT, "the KV header names no known data path")
        return header

    def _check_size(self, num_tokens: int, slot: _Slot) -> None:
        """Before anything is allocated for it: the cache may be no larger than its request's prompt."""
        if not 1 <= num_tokens <= slot.max_tokens:
            raise KvTransferError(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"the KV header declares {num_tokens} tokens, but the decode request waits for the KV of "
                f"a prompt of {slot.max_tokens}",
            )
        if self.max_tokens is not None and num_tokens > self.max_tokens:
            raise KvTransferError(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"the KV cache of {num_tokens} tokens exceeds this worker's KV pool ({self.max_tokens} tokens)",
            )

    def _read_cache(self, conn: socket.socket, header: dict) -> ReceivedKv:
        lay = self.layout
        num_tokens = int(header["num_tokens"])
        prompt = _recv_exact(conn, num_tokens * TOKEN_ID.size, "the prompt's token ids")
        total_blocks = -(-num_tokens // lay.block_size)
        nbytes = total_blocks * lay.block_nbytes
        buffer = self.staging.acquire(nbytes)
        try:
            chunks = self._read_frames(conn, header, buffer, total_blocks)
        except BaseException:
            self.staging.release(buffer)
            raise
        first_token_id, chunks = chunks
        return ReceivedKv(
            prompt_token_ids=[token for (token,) in TOKEN_ID.iter_unpack(prompt)],
            first_token_id=first_token_id, num_tokens=num_tokens, chunks=chunks, nbytes=nbytes,
            data_path=header["data_path"], release=_once(lambda: self.staging.release(buffer)),
        )

    def _read_frames(self, conn: socket.socket, header: dict, buffer: torch.Tensor, total_blocks: int):
        lay = self.layout
        shm = self._segments.view(str(header.get("segment", ""))) if header["data_path"] == "shm" else None
        view = memoryview(buffer.numpy())
        chunks, next_block = [], 0
        while True:
            kind, first, count, offset, digest = FRAME.unpack(_recv_exact(conn, FRAME.size, "a KV frame"))
            if kind == b"K":
                continue
            if kind == b"X":
                reason = _recv_json(conn, "the KV abort reason").get("reason", "")
                raise KvTransferError(grpc.StatusCode.ABORTED, f"the prefill worker aborted the KV transfer: {reason}")
            if kind == b"E":
                if next_block != total_blocks:
                    raise KvTransferError(
                        grpc.StatusCode.DATA_LOSS,
                        f"the KV stream ended after {next_block} of {total_blocks} blocks",
                    )
                return first, chunks
            if kind != b"C" or first != next_block or count == 0 or first + count > total_blocks:
                raise KvTransferError(grpc.StatusCode.INVALID_ARGUMENT, "a KV frame is out of order or out of range")
            start, size = first * lay.block_nbytes, count * lay.block_nbytes
            target = view[start:start + size]
            if shm is None:
                _recv_into(conn, target, f"KV blocks {first}..{first + count - 1}")
            else:
                if offset + size > len(shm):
                    raise KvTransferError(grpc.StatusCode.INVALID_ARGUMENT, "a KV frame points past its segment")
                target[:] = shm[offset:offset + size]
            if checksum(target) != digest:
                raise KvTransferError(
                    grpc.StatusCode.DATA_LOSS, f"KV blocks {first}..{first + count - 1} failed their checksum"
                )
            data = buffer[start:start + size].view(lay.dtype).view(
                lay.num_layers, 2, count, lay.block_size, lay.kv_heads, lay.head_dim
            )
            chunks.append((first, data))
            next_block = first + count


def _once(function: Callable[[], None]) -> Callable[[], None]:
    """A buffer handed back twice would be handed out twice: release callbacks work once."""
    lock, done = threading.Lock(), []

    def call() -> None:
        with lock:
            if done:
                return
            done.append(True)
        function()

    return call


def _try_send_json(conn: socket.socket, message: dict) -> None:
    try:
        _send_json(conn, message)
    except OSError:
        pass


# ---- sending side -------------------------------------------------------------------------------

@dataclass(frozen=True)
class Peer:
    host: str
    port: int
    same_host: bool


def peer_from_endpoint(decode_address: str, endpoint, layout: KvLayout, allow_shm: bool = True) -> Peer:
    """Checks that the decode worker's KV layout matches ours and whether its probe file is visible
    here (then shared memory reaches it)."""
    if endpoint.block_size != layout.block_size or endpoint.dtype != dtype_name(layout.dtype):
        raise KvTransferError(
            grpc.StatusCode.FAILED_PRECONDITION,
            f"the decode worker at {decode_address} stores KV in blocks of {endpoint.block_size} tokens of "
            f"{endpoint.dtype}; this worker uses {layout.block_size} of {dtype_name(layout.dtype)}",
        )
    host = endpoint.data_host
    if not host or host in ("0.0.0.0", "::"):
        host = decode_address.rpartition(":")[0].strip("[]")
    same_host = False
    if allow_shm and endpoint.shm_probe_name.startswith(SHM_PREFIX) and "/" not in endpoint.shm_probe_name:
        try:
            with open(os.path.join(SHM_DIR, endpoint.shm_probe_name), "rb") as probe:
                same_host = hmac.compare_digest(probe.read(64), endpoint.shm_probe_nonce)
        except OSError:
            same_host = False
    return Peer(host, endpoint.data_port, same_host)


@dataclass(eq=False)
class _PoolChunk:
    """A chunk handed to the transfer as views into the KV pool, until it is sent or copied out."""

    first_block: int
    count: int
    views: list
    lock: threading.Lock = field(default_factory=threading.Lock)
    done: bool = False  # sent, copied out of the pool, or dropped


class OutgoingKv:
    """One request's KV on its way out. The engine's forward thread hands over blocks as they are
    computed (`write_blocks`: views into the pool, or a copy into a segment or staging buffer); `send`,
    on a thread of its own, streams each chunk at once. `finish` gives the first token and ends the
    stream; `abort` stops it."""

    def __init__(
        self, sender: "KvSender", request_id: str, transfer_token: bytes, prompt_token_ids: list[int], peer: Peer
    ) -> None:
        self._sender = sender
        self.layout = sender.layout
        self.request_id = request_id
        self._token = transfer_token
        self._prompt = prompt_token_ids
        self.peer = peer
        self.data_path = "shm" if peer.same_host else "tcp"
        self.num_tokens = len(prompt_token_ids)
        self.nbytes = -(-self.num_tokens // self.layout.block_size) * self.layout.block_nbytes  # whole blocks
        # Over TCP from a host-memory pool, chunks are sent straight from the pool's blocks (no copy);
        # otherwise they are copied into a segment (shared memory) or a pinned buffer (GPU pool).
        self._zero_copy = not peer.same_host and sender.send_from_pool
        self._segment = sender.segments.acquire(self.nbytes) if peer.same_host else None
        self._buffer = None
        if not self._zero_copy:
            self._buffer = self._segment.tensor if self._segment else sender.staging.acquire(self.nbytes)
        self.blocks_staged = 0  # advanced by the engine when it plans a staging copy
        self._events: queue.Queue = queue.Queue()
        self._released = False
        self._lock = threading.Lock()
        self._pool_chunks: list[_PoolChunk] = []  # chunks handed over as views into the pool

    def write_blocks(self, runner, block_ids: list[int], first_block: int) -> None:
        """Stages computed blocks (on the forward thread, where the pool is consistent)."""
        if self._zero_copy:
            chunk = _PoolChunk(first_block, len(block_ids), runner.block_views(block_ids))
            with self._lock:
                if self._released:
                    return
                self._pool_chunks = [c for c in self._pool_chunks if not c.done] + [chunk]
            self._events.put(("chunk", chunk, 0))
            return
        lay = self.layout
        start, size = first_block * lay.block_nbytes, len(block_ids) * lay.block_nbytes
        out = self._buffer[start:start + size].view(lay.dtype).view(
            lay.num_layers, 2, len(block_ids), lay.block_size, lay.kv_heads, lay.head_dim
        )
        with self._lock:  # the buffer may not go back to its pool while the forward thread fills it
            if self._released:
                return
            runner.read_blocks(block_ids, out)
        self._events.put(("chunk", first_block, len(block_ids)))

    def wait_sent(self) -> None:
        """Makes sure no chunk still to be sent points into the pool: the engine calls it on the forward
        thread before a step may overwrite the blocks of a request that finished or was preempted. A
        chunk on the wire is waited for; one not sent yet is copied out (the pool stays consistent while
        the forward thread does this)."""
        with self._lock:
            chunks = list(self._pool_chunks)
        for chunk in chunks:
            with chunk.lock:
                if not chunk.done:
                    chunk.views = [memoryview(bytes(view)) for view in chunk.views]
                    chunk.done = True  # no longer in the pool; still to be sent

    def finish(self, first_token_id: int) -> None:
        self._events.put(("end", first_token_id, 0))

    def abort(self, reason: str) -> None:
        self._events.put(("abort", reason, 0))

    def send(self) -> int:
        """Connects, streams, and waits for the receiver's verdict; returns bytes sent. Blocking."""
        timeout = self._sender.io_timeout
        try:
            with socket.create_connection((self.peer.host, self.peer.port), timeout=timeout) as sock:
                _tune(sock)
                self._hello(sock)
                try:
                    self._stream(sock, timeout)
                except OSError:
                    _check_reply(_reply_after_close(sock))
                    raise
                reply = _recv_json(sock, "the decode worker's acknowledgement")
                _check_reply(reply)
                self._sender.bytes_sent += self.nbytes
                return self.nbytes
        except TimeoutError:
            raise KvTransferError(
                grpc.StatusCode.DEADLINE_EXCEEDED,
                f"the decode worker's data port {self.peer.host}:{self.peer.port} did not respond in {timeout} s",
            ) from None
        except OSError as error:
            raise KvTransferError(
                grpc.StatusCode.UNAVAILABLE,
                f"the KV connection to {self.peer.host}:{self.peer.port} failed: {error}",
            ) from None
        finally:
            self.release()

    def _hello(self, sock: socket.socket) -> None:
        lay = self.layout
        header = {
            "request_id": self.request_id, "transfer_token": self._token.hex(), "data_path": self.data_path,
            "segment": self._segment.name if self._segment else "", "num_tokens": self.num_tokens,
            "num_layers": lay.num_layers, "kv_heads": lay.kv_heads, "head_dim": lay.head_dim,
            "block_size": lay.block_size, "dtype": dtype_name(lay.dtype),
        }
        body = json.dumps(header).encode()
        sock.sendall(MAGIC + struct.pack("<I", len(body)) + body)
        sock.settimeout(self._sender.hello_timeout)  # the decode request may register a little later
        _check_reply(_recv_json(sock, "the decode worker's answer to the KV hello"))
        sock.settimeout(self._sender.io_timeout)
        sock.sendall(struct.pack(f"<{len(self._prompt)}I", *self._prompt))

    def _stream(self, sock: socket.socket, keepalive: float) -> None:
        lay = self.layout
        view = None if self._buffer is None else memoryview(self._buffer.numpy())
        while True:
            try:
                kind, value, count = self._events.get(timeout=keepalive / 3)
            except queue.Empty:
                sock.sendall(FRAME.pack(b"K", 0, 0, 0, 0))
                continue
            if kind == "end":
                sock.sendall(FRAME.pack(b"E", value, 0, 0, 0))
                return
            if kind == "abort":
                body = json.dumps({"reason": value}).encode()
                sock.sendall(FRAME.pack(b"X", 0, 0, 0, 0) + struct.pack("<I", len(body)) + body)
                raise KvTransferError(grpc.StatusCode.ABORTED, f"the KV transfer was aborted: {value}")
            if self._zero_copy:
                self._send_from_pool(sock, value)
                continue
            start, size = value * lay.block_nbytes, count * lay.block_nbytes
            data = view[start:start + size]
            sock.sendall(FRAME.pack(b"C", value, count, start, checksum(data)))
            if self._segment is None:
                sock.sendall(data)

    def _send_from_pool(self, sock: socket.socket, chunk: "_PoolChunk") -> None:
        with chunk.lock:
            digest = xxhash.xxh3_64()
            for part in chunk.views:
                digest.update(part)
            sock.sendall(FRAME.pack(b"C", chunk.first_block, chunk.count, 0, digest.intdigest()))
            _sendmsg_all(sock, chunk.views)
            chunk.done = True

    def release(self) -> None:
        with self._lock:
            if self._released:
                return
            self._released = True
            chunks, self._pool_chunks = self._pool_chunks, []
        for chunk in chunks:  # never to be sent: they no longer hold on to the pool
            with chunk.lock:
                chunk.done = True
        if self._segment is not None:
            self._sender.segments.release(self._segment)
        elif self._buffer is not None:
            self._sender.staging.release(self._buffer)


class KvSender:
    """The prefill worker's side: learns each decode worker's data endpoint once, then opens transfers."""

    def __init__(
        self, layout: KvLayout, io_timeout: float = 5.0, hello_timeout: float = 10.0, allow_shm: bool = True,
        pin: bool = False,
    ) -> None:
        self.layout = layout
        self.send_from_pool = not pin  # a host-memory KV pool: TCP sends read its blocks directly
        self.io_timeout = io_timeout
        self.hello_timeout = hello_timeout  # above the receiver's arrival timeout
        self.allow_shm = allow_shm
        self.staging = StagingPool(pin=pin)
        self.segments = SharedSegments()
        self.peers: dict[str, Peer] = {}
        self.bytes_sent = 0

    def open(self, request_id: str, transfer_token: bytes, prompt_token_ids: list[int], peer: Peer) -> OutgoingKv:
        return OutgoingKv(self, request_id, transfer_token, prompt_token_ids, peer)

    def close(self) -> None:
        self.segments.close()
