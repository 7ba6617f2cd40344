"""The sending side of the KV data path: one `OutgoingKv` per request streams its KV blocks to a decode
worker's data port while the prompt is still being computed; `KvSender` opens them.

A decode worker that already holds the prompt's first blocks in its prefix cache says how many in its
answer to the hello; the transfer then stages and sends only the blocks after them. Chunks staged before
that answer came are sent whole or not at all: the transfer then starts at the start of the chunk that
runs across the held blocks' end, and tells the receiver where it starts."""

import queue
import socket
import struct
import threading
from dataclasses import dataclass

import grpc

from diptych_common.proto.v1 import worker_pb2
from workers.engine.kv_transfer import Peer
from workers.kv_connector import host_identity
from workers.kv_connector.nixl import NixlFromPool, NixlSend, RegisteredStaging
from workers.kv_connector.paths import BytesByPath, SendPath, StagedChunk
from workers.kv_connector.shm import SharedSegments, ShmSend, probe_matches
from workers.kv_connector.staging import StagingPool
from workers.kv_connector.tcp import TcpFromBuffer, TcpFromPool
from workers.kv_connector.timeouts import DEFAULT_KV_TIMEOUTS, KvTimeouts
from workers.kv_connector.wire import (
    FIRST_BLOCK,
    KvTransferError,
    abort_frame,
    check_reply,
    dtype_name,
    encode_hello,
    end_frame,
    held_blocks_of,
    keepalive_frame,
    recv_json,
    reply_after_close,
    tune,
)
from workers.runner.kv_pool import KvLayout, KvSource


def peer_from_endpoint(
    decode_address: str, endpoint: worker_pb2.KvEndpoint, layout: KvLayout, allow_shm: bool = True, host_id: str = ""
) -> Peer:
    """Checks that the decode worker's KV layout (a worker_pb2.KvEndpoint) matches ours, whether its
    probe file is visible here and names our host id (`host_id`, empty: this process's; then shared
    memory reaches it), and whether it takes NIXL writes."""
    if endpoint.block_size != layout.block_size or endpoint.dtype != dtype_name(layout.dtype):
        raise KvTransferError(
            grpc.StatusCode.FAILED_PRECONDITION,
            f"the decode worker at {decode_address} stores KV in blocks of {endpoint.block_size} tokens of "
            f"{endpoint.dtype}; this worker uses {layout.block_size} of {dtype_name(layout.dtype)}",
        )
    host = endpoint.data_host
    if not host or host in ("0.0.0.0", "::"):
        host = decode_address.rpartition(":")[0].strip("[]")
    same_host = allow_shm and probe_matches(
        endpoint.shm_probe_name, endpoint.shm_probe_nonce, host_identity.host_id(host_id)
    )
    return Peer(host, endpoint.data_port, same_host, endpoint.nixl)


@dataclass(frozen=True)
class _End:
    first_token_id: int


@dataclass(frozen=True)
class _Abort:
    reason: str


class OutgoingKv:
    """One request's KV on its way out. The engine's forward thread hands over blocks as they are
    computed (`write_blocks`); `send`, on a thread of its own, streams each chunk at once, from the first
    block the receiver lacks (`first_block`, fixed once it answered the hello). `finish` gives the first
    token and ends the stream; `abort` stops it."""

    def __init__(
        self,
        sender: "KvSender",
        request_id: str,
        transfer_token: bytes,
        prompt_token_ids: list[int],
        peer: Peer,
        traceparent: str = "",
    ) -> None:
        self._sender = sender
        self._traceparent = traceparent
        self.layout = sender.layout
        self.request_id = request_id
        self._token = transfer_token
        self._prompt = prompt_token_ids
        self.peer = peer
        self.num_tokens = len(prompt_token_ids)
        self.num_blocks = -(-self.num_tokens // self.layout.block_size)  # whole blocks, the last partly filled
        # Buffers hold every block at its place in the prompt, whatever the receiver turns out to hold.
        self._path: SendPath = sender.path_to(peer, self.num_blocks * self.layout.block_nbytes)
        self.data_path = self._path.data_path
        self._events: queue.Queue[StagedChunk | _End | _Abort] = queue.Queue()
        self._staging = threading.Lock()  # staging, and fixing first_block, one at a time
        self._staged: list[tuple[int, int]] = []  # blocks (from, to) of chunks staged before first_block was fixed
        self.first_block: int | None = None  # fixed once, by the sending thread, from the hello's answer

    @property
    def nbytes(self) -> int:
        """The bytes this transfer moves: the blocks from `first_block` on (all, until it is fixed)."""
        return (self.num_blocks - (self.first_block or 0)) * self.layout.block_nbytes

    def write_blocks(self, runner: KvSource, block_ids: list[int], first_block: int) -> None:
        """Stages computed blocks (on the forward thread, where the pool is consistent); once the receiver
        said which blocks it holds, only those after them."""
        with self._staging:
            if self.first_block is None:
                self._staged.append((first_block, first_block + len(block_ids)))
            else:
                skip = max(0, self.first_block - first_block)
                block_ids, first_block = block_ids[skip:], first_block + skip
                if not block_ids:
                    return
            chunk = self._path.stage(runner, block_ids, first_block)
        if chunk is not None:
            self._events.put(chunk)

    def _fix_first_block(self, held: int) -> int:
        """The first block to send when the receiver holds `held` leading blocks: `held`, or, when a chunk
        staged already runs across it, that chunk's start (a chunk leaves whole or not at all)."""
        with self._staging:
            first = held
            for start, end in sorted(self._staged, reverse=True):
                if start < first < end:
                    first = start
            self.first_block = first
            return first

    def wait_sent(self) -> None:
        """Called on the forward thread before a step may overwrite the blocks of a request that finished
        or was preempted: no chunk still to be sent reads them any more."""
        self._path.wait_sent()

    def finish(self, first_token_id: int) -> None:
        self._events.put(_End(first_token_id))

    def abort(self, reason: str) -> None:
        self._events.put(_Abort(reason))

    def send(self) -> int:
        """Connects, streams, and waits for the receiver's verdict; returns bytes sent. Blocking."""
        timeout = self._sender.io_timeout
        try:
            with socket.create_connection((self.peer.host, self.peer.port), timeout=timeout) as sock:
                tune(sock)
                self._hello(sock)
                try:
                    self._stream(sock, timeout)
                except OSError:
                    check_reply(reply_after_close(sock))
                    raise
                check_reply(recv_json(sock, "the decode worker's acknowledgement"))
                self._sender.sent.add(self.data_path, self.nbytes)
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
        """The hello and its answer; then the first block sent (when the receiver said which it holds)
        and the prompt. A receiver that claims more than it may hold is told why, and nothing is sent."""
        sock.sendall(
            encode_hello(
                self.request_id,
                self._token,
                self.layout,
                self.num_tokens,
                self.data_path,
                self._path.segment,
                self._traceparent,
            )
        )
        sock.settimeout(self._sender.hello_timeout)  # the decode request may register a little later
        reply = recv_json(sock, "the decode worker's answer to the KV hello")
        check_reply(reply)
        sock.settimeout(self._sender.io_timeout)
        refusal = None
        try:
            held = held_blocks_of(reply, self.num_tokens, self.layout.block_size)
        except KvTransferError as error:
            held, refusal = 0, error
        first = self._fix_first_block(held)
        start = FIRST_BLOCK.pack(first) if "held_blocks" in reply else b""
        sock.sendall(start + struct.pack(f"<{len(self._prompt)}I", *self._prompt))
        if refusal is not None:
            sock.sendall(abort_frame(str(refusal)))  # the receiver reads frames next: it learns why
            raise refusal
        self._path.after_hello(sock, first)

    def _stream(self, sock: socket.socket, keepalive: float) -> None:
        while True:
            try:
                event = self._events.get(timeout=keepalive / 3)
            except queue.Empty:
                sock.sendall(keepalive_frame())
                continue
            if isinstance(event, _End):
                sock.sendall(end_frame(event.first_token_id))
                return
            if isinstance(event, _Abort):
                sock.sendall(abort_frame(event.reason))
                raise KvTransferError(grpc.StatusCode.ABORTED, f"the KV transfer was aborted: {event.reason}")
            if self._leaves(event):
                self._path.send(sock, event)

    def _leaves(self, chunk: StagedChunk) -> bool:
        """Whether the chunk goes out: it starts at or after `first_block` (one staged before that was
        fixed never runs across it; one before it holds blocks the receiver has)."""
        first = self.first_block or 0
        if chunk.first_block >= first:
            return True
        if chunk.first_block + chunk.count > first:
            raise KvTransferError(
                grpc.StatusCode.INTERNAL,
                f"KV blocks {chunk.first_block}..{chunk.first_block + chunk.count - 1} were staged across "
                f"block {first}, where the transfer starts",
            )
        return False

    def release(self) -> None:
        """Gives back what the transfer holds; chunks not sent yet are dropped."""
        self._path.release()


class KvSender:
    """The prefill worker's side of the data path: opens transfers, and holds what they share (staging
    buffers, shared-memory segments, the count of bytes delivered)."""

    def __init__(
        self,
        layout: KvLayout,
        timeouts: KvTimeouts = DEFAULT_KV_TIMEOUTS,
        allow_shm: bool = True,
        pin: bool = False,
        nixl: RegisteredStaging | None = None,
        host_id: str = "",
    ) -> None:
        self.layout = layout
        self.host_id = host_identity.host_id(host_id)  # shared memory only to decode workers of this id
        self.send_from_pool = not pin  # a host-memory KV pool: TCP sends read its blocks directly
        self.timeouts = timeouts
        self.io_timeout = timeouts.io_s
        self.hello_timeout = timeouts.hello_answer_s
        self.allow_shm = allow_shm
        self.staging = StagingPool(pin=pin)
        self.segments = SharedSegments()
        self.nixl = nixl  # this worker's NIXL agent's staging buffers, when it has one
        self.sent = BytesByPath()  # delivered whole

    def open(
        self, request_id: str, transfer_token: bytes, prompt_token_ids: list[int], peer: Peer, traceparent: str = ""
    ) -> OutgoingKv:
        return OutgoingKv(self, request_id, transfer_token, prompt_token_ids, peer, traceparent)

    def path_to(self, peer: Peer, nbytes: int) -> SendPath:
        """Shared memory to a peer on this host; NIXL where both sides run an agent; otherwise TCP. NIXL and
        TCP send straight from a host-memory pool, and through a (registered or pinned) buffer from a GPU
        pool."""
        if peer.same_host:
            return ShmSend(self.segments, self.layout, nbytes)
        if peer.nixl and self.nixl is not None:
            if self.send_from_pool:
                return NixlFromPool(self.nixl, self.layout, self.io_timeout)
            return NixlSend(self.nixl, self.layout, nbytes, self.io_timeout)
        if self.send_from_pool:
            return TcpFromPool()
        return TcpFromBuffer(self.staging, self.layout, nbytes)

    @property
    def bytes_sent(self) -> int:
        return self.sent.total

    def close(self) -> None:
        self.segments.close()
