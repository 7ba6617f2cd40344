"""The receiving side of the KV data path: the decode worker's data port.

The receiver hands a cache over only when every block arrived and every checksum matched, so a half-
received cache is never decoded. Both sides time out after `KvTimeouts.io_s` seconds without progress.

Nothing is allocated for a peer before it proved it may send, since the port is reachable before any
gRPC credential is checked: the hello is small and bounded and must arrive whole within `KvTimeouts.hello_s`;
the transfer token is checked, and the declared size against what the waiting decode request needs and
the KV pool holds, before the prompt is read or a buffer is taken; and the number of open data
connections is bounded (one thread each), beyond which connections are refused.

A decode call that already holds the prompt's first blocks (pinned in its prefix cache when it
registered) says so in the reply to the hello of a sender that can skip them; the cache then arrives
from the block the sender names (no later than the first block the call lacks), checked to start
exactly there, and under the prompt the call declared.
"""

import contextlib
import hmac
import logging
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple

import grpc
import torch

from workers.kv_connector import host_identity
from workers.kv_connector.nixl import NixlReceive, RegisteredStaging
from workers.kv_connector.paths import BytesByPath, ReceivePath, blocks_in
from workers.kv_connector.shm import SegmentReader, ShmReceive, make_probe, remove_file
from workers.kv_connector.staging import StagingPool
from workers.kv_connector.tcp import TcpReceive
from workers.kv_connector.timeouts import DEFAULT_KV_TIMEOUTS, KvTimeouts
from workers.kv_connector.wire import (
    ABORT,
    CHUNK,
    END,
    FIRST_BLOCK,
    FRAME,
    KEEPALIVE,
    TOKEN_ID,
    Hello,
    KvTransferError,
    checksum,
    error_reply,
    max_held_blocks,
    read_hello,
    recv_exact,
    recv_json,
    send_json,
    try_send_json,
    tune,
)
from workers.runner.kv_pool import KvLayout

log = logging.getLogger(__name__)

MAX_DATA_CONNECTIONS = 256


class KvChunk(NamedTuple):
    """Blocks first_block.. of a request's KV: data [layers, 2, blocks, block_size, kv_heads, head_dim]."""

    first_block: int
    data: torch.Tensor


@dataclass(eq=False)
class ReceivedKv:
    prompt_token_ids: list[int]
    first_token_id: int
    num_tokens: int
    chunks: list[KvChunk]  # views into one staging buffer, in block order, from block first_block on
    nbytes: int  # whole blocks, the last one partly filled: what moved
    data_path: str
    release: Callable[[], None]  # gives the staging buffer back; works once
    first_block: int = 0  # the blocks before it did not move: the decode worker holds them
    # for the decode worker's kv.receive span: the sender's trace context and when the transfer ran here
    traceparent: str = ""
    started_ns: int = 0
    finished_ns: int = 0


KvArrivalCallback = Callable[[ReceivedKv | KvTransferError], None]  # a transfer ended: its KV or its error


@dataclass
class _Slot:
    transfer_token: bytes
    deliver: KvArrivalCallback  # called once, on a receiver thread
    max_tokens: int  # the prompt length the decode request declared: no larger cache is accepted
    held_blocks: int = 0  # leading blocks of the prompt the decode worker holds (pinned for the request)
    prompt_token_ids: tuple[int, ...] = ()  # the prompt the decode request declared, when it did
    claimed: bool = False


class KvInbox:
    """Where decode requests wait for their KV. Thread-safe: transfers arrive on receiver threads.
    A transfer may arrive before its request registers; it then waits up to `timeouts.arrival_s`."""

    def __init__(self, timeouts: KvTimeouts = DEFAULT_KV_TIMEOUTS) -> None:
        self._arrival_timeout = timeouts.arrival_s
        self._slots: dict[str, _Slot] = {}
        self._changed = threading.Condition()

    def expect(
        self,
        request_id: str,
        transfer_token: bytes,
        deliver: KvArrivalCallback,
        max_tokens: int,
        held_blocks: int = 0,
        prompt_token_ids: tuple[int, ...] = (),
    ) -> None:
        """Registers a decode request. With `prompt_token_ids` (of `max_tokens` tokens) the KV must come
        with that prompt, and a sender that can skip them is told the request holds `held_blocks` of it."""
        if prompt_token_ids and len(prompt_token_ids) != max_tokens:
            raise KvTransferError(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"the decode request gives {len(prompt_token_ids)} prompt token ids for a prompt of {max_tokens}",
            )
        if held_blocks and not prompt_token_ids:
            raise KvTransferError(grpc.StatusCode.INVALID_ARGUMENT, "held blocks need the prompt they hold")
        with self._changed:
            if request_id in self._slots:
                raise KvTransferError(grpc.StatusCode.ALREADY_EXISTS, f"request {request_id} already waits for KV")
            self._slots[request_id] = _Slot(transfer_token, deliver, max_tokens, held_blocks, prompt_token_ids)
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
        self,
        inbox: KvInbox,
        layout: KvLayout,
        host: str = "127.0.0.1",
        port: int = 0,
        timeouts: KvTimeouts = DEFAULT_KV_TIMEOUTS,
        staging: StagingPool | None = None,
        max_tokens: int | None = None,
        max_connections: int = MAX_DATA_CONNECTIONS,
        nixl: RegisteredStaging | None = None,
        host_id: str = "",
    ) -> None:
        self.inbox = inbox
        self.host_id = host_identity.host_id(host_id)  # written into the shared-memory probe
        self.layout = layout
        self.timeouts = timeouts
        self.io_timeout = timeouts.io_s
        self.hello_timeout = timeouts.hello_s  # the whole hello must arrive within it
        self.max_tokens = max_tokens
        self.staging = staging or StagingPool()
        self.nixl = nixl  # receive buffers this worker's NIXL agent registered, when it has one
        self._connections = threading.BoundedSemaphore(max_connections)
        self.connections_refused = 0
        self._segments = SegmentReader()
        self._listener = socket.create_server((host, port), backlog=128)
        self.host, self.port = self._listener.getsockname()[:2]
        self.received = BytesByPath()  # the caches handed over whole
        self.shm_probe_name = ""
        self.shm_probe_nonce = b""
        self._closed = False
        self._thread = threading.Thread(target=self._accept_forever, name="kv-receiver", daemon=True)

    @property
    def bytes_received(self) -> int:
        return self.received.total

    def start(self) -> None:
        self.shm_probe_name, self.shm_probe_nonce = make_probe(self.host_id)
        self._thread.start()

    def close(self) -> None:
        self._closed = True
        with contextlib.suppress(OSError):
            self._listener.shutdown(socket.SHUT_RDWR)
        self._listener.close()
        if self.shm_probe_name:
            remove_file(self.shm_probe_name)
        self._segments.close()

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
            try_send_json(
                conn,
                {
                    "ok": False,
                    "code": "RESOURCE_EXHAUSTED",
                    "error": "this decode worker has as many KV connections open as it serves; retry shortly",
                },
            )

    def _serve(self, conn: socket.socket) -> None:
        try:
            self._serve_connection(conn)
        finally:
            self._connections.release()

    def _serve_connection(self, conn: socket.socket) -> None:
        slot = None
        try:
            with conn:
                tune(conn)
                try:
                    hello = read_hello(conn, self.layout, time.monotonic() + self.hello_timeout)
                    started_ns = time.time_ns()
                    conn.settimeout(self.io_timeout)
                    slot = self.inbox.claim(hello.request_id, hello.transfer_token)
                    self._check_size(hello.num_tokens, slot)
                    held = self._held_for(hello, slot)
                    send_json(conn, {"ok": True} if held is None else {"ok": True, "held_blocks": held})
                    received = self._read_cache(conn, hello, slot, held)
                    received.traceparent = hello.traceparent
                    received.started_ns, received.finished_ns = started_ns, time.time_ns()
                except KvTransferError as error:
                    if slot is not None:
                        slot.deliver(error)
                    try_send_json(conn, error_reply(error))
                    return
                self.received.add(received.data_path, received.nbytes)
                slot.deliver(received)
                try_send_json(conn, {"ok": True, "bytes": received.nbytes})
        except Exception as error:  # never let a bad peer kill the thread silently
            log.exception("KV receive failed")
            if slot is not None:
                slot.deliver(KvTransferError(grpc.StatusCode.INTERNAL, f"the KV receive failed: {error}"))

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

    def _held_for(self, hello: Hello, slot: _Slot) -> int | None:
        """The leading blocks the sender may leave out: those the request holds, when the cache is of the
        prompt the request declared (never the block of its last token). None: the sender cannot."""
        if not hello.skip_held:
            return None
        if hello.num_tokens != len(slot.prompt_token_ids):
            return 0
        return min(slot.held_blocks, max_held_blocks(hello.num_tokens, self.layout.block_size))

    def _read_cache(self, conn: socket.socket, hello: Hello, slot: _Slot, held: int | None) -> ReceivedKv:
        num_tokens = hello.num_tokens
        first_block = 0
        if held is not None:
            (first_block,) = FIRST_BLOCK.unpack(recv_exact(conn, FIRST_BLOCK.size, "the first KV block sent"))
            if first_block > held:
                raise KvTransferError(
                    grpc.StatusCode.INVALID_ARGUMENT,
                    f"the KV stream starts at block {first_block}, but this worker holds only the first {held}",
                )
        ids = recv_exact(conn, num_tokens * TOKEN_ID.size, "the prompt's token ids")
        prompt = [token for (token,) in TOKEN_ID.iter_unpack(ids)]
        if slot.prompt_token_ids and tuple(prompt) != slot.prompt_token_ids:
            raise KvTransferError(
                grpc.StatusCode.INVALID_ARGUMENT,
                "the KV cache comes with another prompt than the one its decode request declared",
            )
        total_blocks = -(-num_tokens // self.layout.block_size)
        nbytes = (total_blocks - first_block) * self.layout.block_nbytes
        staging = self._staging_for(hello.data_path)
        buffer = staging.acquire(nbytes)
        try:
            path = self._path_of(hello, conn, buffer, nbytes)
            first_token_id, chunks = self._read_frames(conn, path, buffer, first_block, total_blocks)
        except BaseException:
            staging.release(buffer)
            raise
        return ReceivedKv(
            prompt_token_ids=prompt,
            first_token_id=first_token_id,
            num_tokens=num_tokens,
            chunks=chunks,
            nbytes=nbytes,
            data_path=hello.data_path,
            release=_once(lambda: staging.release(buffer)),
            first_block=first_block,
        )

    def _staging_for(self, data_path: str) -> StagingPool:
        if data_path != "nixl":
            return self.staging
        if self.nixl is None:
            raise KvTransferError(grpc.StatusCode.FAILED_PRECONDITION, "this decode worker runs no NIXL agent")
        return self.nixl

    def _path_of(self, hello: Hello, conn: socket.socket, buffer: torch.Tensor, nbytes: int) -> ReceivePath:
        if hello.data_path == "shm":
            return ShmReceive(self._segments.view(hello.segment))
        if hello.data_path == "nixl":
            assert self.nixl is not None  # (`_staging_for` refused the hello otherwise)
            send_json(conn, self.nixl.target_of(buffer, nbytes).to_json())  # only now: the token checked out
            return NixlReceive(buffer, self.nixl.agent)
        return TcpReceive()

    def _read_frames(
        self, conn: socket.socket, path: ReceivePath, buffer: torch.Tensor, first_block: int, total_blocks: int
    ) -> tuple[int, list[KvChunk]]:
        """Reads frames, blocks `first_block`.. in order, until the end frame; returns the first token and
        the chunks, each checked. The buffer holds block `first_block` at its start."""
        lay = self.layout
        view = buffer.numpy().data
        chunks: list[KvChunk] = []
        next_block = first_block
        while True:
            path.wait_frame(conn)
            kind, first, count, offset, digest = FRAME.unpack(recv_exact(conn, FRAME.size, "a KV frame"))
            if kind == KEEPALIVE:
                continue
            if kind == ABORT:
                reason = recv_json(conn, "the KV abort reason").get("reason", "")
                raise KvTransferError(grpc.StatusCode.ABORTED, f"the prefill worker aborted the KV transfer: {reason}")
            if kind == END:
                if next_block != total_blocks:
                    raise KvTransferError(
                        grpc.StatusCode.DATA_LOSS,
                        f"the KV stream ended after {next_block} of {total_blocks} blocks",
                    )
                return first, chunks
            if kind != CHUNK or first != next_block or count == 0 or first + count > total_blocks:
                raise KvTransferError(grpc.StatusCode.INVALID_ARGUMENT, "a KV frame is out of order or out of range")
            start, size = (first - first_block) * lay.block_nbytes, count * lay.block_nbytes
            target = view[start : start + size]
            what = f"KV blocks {first}..{first + count - 1}"
            path.read(conn, target, offset, what)
            if checksum(target) != digest:
                raise KvTransferError(grpc.StatusCode.DATA_LOSS, f"{what} failed their checksum")
            chunks.append(KvChunk(first, blocks_in(buffer, lay, first - first_block, count)))
            next_block = first + count


def _once(function: Callable[[], None]) -> Callable[[], None]:
    """A buffer handed back twice would be handed out twice: release callbacks work once."""
    lock, done = threading.Lock(), list[bool]()

    def call() -> None:
        with lock:
            if done:
                return
            done.append(True)
        function()

    return call
