"""The sending side of the KV data path: one `OutgoingKv` per request streams its KV blocks to a decode
worker's data port while the prompt is still being computed; `KvSender` opens them."""

import queue
import socket
import struct
import threading
from dataclasses import dataclass

import grpc

from workers.kv_connector.base import Peer
from workers.kv_connector.paths import SendPath, StagedChunk
from workers.kv_connector.shm import SharedSegments, ShmSend, probe_matches
from workers.kv_connector.staging import StagingPool
from workers.kv_connector.tcp import TcpFromBuffer, TcpFromPool
from workers.kv_connector.wire import (
    KvTransferError,
    abort_frame,
    check_reply,
    dtype_name,
    encode_hello,
    end_frame,
    keepalive_frame,
    recv_json,
    reply_after_close,
    tune,
)
from workers.model_runner import KvLayout


def peer_from_endpoint(decode_address: str, endpoint, layout: KvLayout, allow_shm: bool = True) -> Peer:
    """Checks that the decode worker's KV layout (a worker_pb2.KvEndpoint) matches ours, and whether its
    probe file is visible here (then shared memory reaches it)."""
    if endpoint.block_size != layout.block_size or endpoint.dtype != dtype_name(layout.dtype):
        raise KvTransferError(
            grpc.StatusCode.FAILED_PRECONDITION,
            f"the decode worker at {decode_address} stores KV in blocks of {endpoint.block_size} tokens of "
            f"{endpoint.dtype}; this worker uses {layout.block_size} of {dtype_name(layout.dtype)}",
        )
    host = endpoint.data_host
    if not host or host in ("0.0.0.0", "::"):
        host = decode_address.rpartition(":")[0].strip("[]")
    same_host = allow_shm and probe_matches(endpoint.shm_probe_name, endpoint.shm_probe_nonce)
    return Peer(host, endpoint.data_port, same_host)


@dataclass(frozen=True)
class _End:
    first_token_id: int


@dataclass(frozen=True)
class _Abort:
    reason: str


class OutgoingKv:
    """One request's KV on its way out. The engine's forward thread hands over blocks as they are
    computed (`write_blocks`); `send`, on a thread of its own, streams each chunk at once. `finish` gives
    the first token and ends the stream; `abort` stops it."""

    def __init__(
        self, sender: "KvSender", request_id: str, transfer_token: bytes, prompt_token_ids: list[int], peer: Peer
    ) -> None:
        self._sender = sender
        self.layout = sender.layout
        self.request_id = request_id
        self._token = transfer_token
        self._prompt = prompt_token_ids
        self.peer = peer
        self.num_tokens = len(prompt_token_ids)
        self.nbytes = -(-self.num_tokens // self.layout.block_size) * self.layout.block_nbytes  # whole blocks
        self._path: SendPath = sender.path_to(peer, self.nbytes)
        self.data_path = self._path.data_path
        self._events: queue.Queue[StagedChunk | _End | _Abort] = queue.Queue()

    def write_blocks(self, runner, block_ids: list[int], first_block: int) -> None:
        """Stages computed blocks (on the forward thread, where the pool is consistent)."""
        chunk = self._path.stage(runner, block_ids, first_block)
        if chunk is not None:
            self._events.put(chunk)

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
                self._sender.count_sent(self.nbytes)
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
        sock.sendall(
            encode_hello(self.request_id, self._token, self.layout, self.num_tokens, self.data_path, self._path.segment)
        )
        sock.settimeout(self._sender.hello_timeout)  # the decode request may register a little later
        check_reply(recv_json(sock, "the decode worker's answer to the KV hello"))
        sock.settimeout(self._sender.io_timeout)
        sock.sendall(struct.pack(f"<{len(self._prompt)}I", *self._prompt))

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
            self._path.send(sock, event)

    def release(self) -> None:
        """Gives back what the transfer holds; chunks not sent yet are dropped."""
        self._path.release()


class KvSender:
    """The prefill worker's side of the data path: opens transfers, and holds what they share (staging
    buffers, shared-memory segments, the count of bytes delivered)."""

    def __init__(
        self,
        layout: KvLayout,
        io_timeout: float = 5.0,
        hello_timeout: float = 10.0,
        allow_shm: bool = True,
        pin: bool = False,
    ) -> None:
        self.layout = layout
        self.send_from_pool = not pin  # a host-memory KV pool: TCP sends read its blocks directly
        self.io_timeout = io_timeout
        self.hello_timeout = hello_timeout  # above the receiver's arrival timeout
        self.allow_shm = allow_shm
        self.staging = StagingPool(pin=pin)
        self.segments = SharedSegments()
        self.bytes_sent = 0
        self._count = threading.Lock()

    def open(self, request_id: str, transfer_token: bytes, prompt_token_ids: list[int], peer: Peer) -> OutgoingKv:
        return OutgoingKv(self, request_id, transfer_token, prompt_token_ids, peer)

    def path_to(self, peer: Peer, nbytes: int) -> SendPath:
        """Shared memory to a peer on this host; otherwise TCP, straight from a host-memory pool or
        through a pinned buffer from a GPU pool."""
        if peer.same_host:
            return ShmSend(self.segments, self.layout, nbytes)
        if self.send_from_pool:
            return TcpFromPool()
        return TcpFromBuffer(self.staging, self.layout, nbytes)

    def count_sent(self, nbytes: int) -> None:
        with self._count:  # transfers end on threads of their own
            self.bytes_sent += nbytes

    def close(self) -> None:
        self.segments.close()
