"""The NIXL data path: the prefill worker WRITEs each chunk, one-sided, into a receive buffer the decode
worker registered with its NIXL agent, then sends the chunk's frame (where it wrote, its checksum) on the
transfer's connection. UCX, under NIXL, picks the transport: RDMA between hosts that have it, CUDA IPC or
shared memory on one host, TCP otherwise.

Why WRITE, into a receive buffer, and not READ out of the sender's pool (vLLM's choice): a READ design
registers the prefill worker's whole KV pool and hands its descriptors to every decode worker it serves; a
peer that kept them could read any tenant's KV in that pool for as long as the worker lives. Here the only
memory a peer learns of is the decode worker's receive buffer of one transfer, and it learns of it only
after the hand-shake (the decode worker's endpoint proof, then the request's one-time transfer token on
the data port). Nothing of the decode worker's KV pool is ever registered: a chunk enters that pool only
after its frame arrived on the authenticated connection and its checksum matched. The receive buffers stay registered
and allocated for the worker's life (reused, never freed), because UCX does not revoke a descriptor on
every transport when memory is deregistered: a stale descriptor can then only ever reach a receive
buffer, never memory the allocator has since handed to something else. UCX itself authenticates
nobody, so this path belongs on the fleet's private network, as the data port does.

A sender whose pool is in host memory registers that pool with its own agent once and writes each chunk
straight out of it (`NixlFromPool`: no copy); elsewhere (a tensor-parallel runner's pool is spread over
processes) it stages chunks into a registered buffer of its own (`NixlSend`, copied out of the pool on the
forward thread, as the shared-memory path does). Both registrations are local: a WRITE's initiator sends
no descriptors of its own memory to anyone, so no peer can name the prefill worker's pool.
"""

from __future__ import annotations

import logging
import os
import secrets
import select
import socket
import threading
import time
from dataclasses import dataclass
from typing import Any

import grpc
import numpy as np
import torch
import xxhash
from typing_extensions import override

from workers.kv_connector.interfaces import interface_of
from workers.kv_connector.paths import BufferedSendPath, FromPoolSendPath, PoolChunk, ReceivePath, StagedChunk
from workers.kv_connector.staging import StagingPool
from workers.kv_connector.wire import KvTransferError, check_reply, checksum, chunk_frame, recv_json
from workers.runner.kv_pool import KvLayout, KvSource

log = logging.getLogger(__name__)

MAX_METADATA_BYTES = 32 << 10  # an agent's metadata with one registered buffer: a few hundred bytes
UCX_NET_DEVICES = "UCX_NET_DEVICES"
OPERATOR_UCX_DEVICES = os.environ.get(UCX_NET_DEVICES)  # as the process was started


def nixl_unavailable() -> str | None:
    """Why this process cannot run a NIXL agent, or None when it can."""
    try:
        import nixl_cu13  # noqa: F401
    except ImportError as error:
        return f"NIXL is not installed ({error}); `pip install nixl-cu13` adds it"
    return None


def nixl_staging(mode: str, role: str, host: str, pin: bool = False) -> RegisteredStaging | None:
    """The worker's NIXL agent, as its staging buffers: `mode` "on" (fails without NIXL), "off", or
    "auto" (on where NIXL is installed). Its UCX listens only on the interface that holds `host`."""
    if mode == "off":
        return None
    reason = nixl_unavailable()
    if reason is not None:
        if mode == "on":
            raise RuntimeError(reason)
        log.info("KV hand-off without NIXL: %s", reason)
        return None
    return RegisteredStaging(NixlAgent(role, host), pin)


@dataclass(frozen=True)
class NixlTarget:
    """Where a transfer's chunks go: the decode worker's agent and the receive buffer it registered."""

    metadata: bytes
    address: int
    size: int

    def to_json(self) -> dict[str, Any]:
        return {"ok": True, "nixl_metadata": self.metadata.hex(), "address": self.address, "size": self.size}

    @classmethod
    def from_json(cls, message: dict[str, Any]) -> NixlTarget:
        try:
            metadata = bytes.fromhex(message["nixl_metadata"])
            address, size = int(message["address"]), int(message["size"])
        except (KeyError, TypeError, ValueError):
            raise KvTransferError(
                grpc.StatusCode.INVALID_ARGUMENT, "the decode worker's NIXL target is malformed"
            ) from None
        if not 0 < len(metadata) <= MAX_METADATA_BYTES or address <= 0 or size <= 0:
            raise KvTransferError(grpc.StatusCode.INVALID_ARGUMENT, "the decode worker's NIXL target is out of range")
        return cls(metadata, address, size)


def limit_ucx_to_interface_of(host: str) -> None:
    """Sets `UCX_NET_DEVICES` (read when an agent starts its UCX context) to the interface holding `host`."""
    if OPERATOR_UCX_DEVICES is not None:
        log.info("NIXL's UCX uses the network devices UCX_NET_DEVICES names: %s", OPERATOR_UCX_DEVICES)
        return
    interface = interface_of(host)
    if interface is None:
        os.environ.pop(UCX_NET_DEVICES, None)
    else:
        os.environ[UCX_NET_DEVICES] = interface


class NixlAgent:
    """One NIXL agent per worker (UCX backend), its registrations, and the remote agents it loaded. NIXL's
    agent is driven from several transfer threads here, so every call into it holds one lock.

    It runs no progress thread: NIXL's polls without pause and would take a fifth of a core from an idle
    worker. UCX moves a write only while both ends progress, so the writer polls its transfer and the
    receiver progresses its agent while it waits for that transfer's frames (`NixlReceive.wait_frame`).

    UCX opens a listener on every network interface it may use and advertises each in the agent's
    metadata, and authenticates nobody: the agent is limited to the interface that holds the worker's
    address (every interface only where the worker serves on all). An operator's own `UCX_NET_DEVICES`
    (an RDMA device, say) is kept."""

    def __init__(self, role: str, host: str) -> None:
        from nixl_cu13 import nixl_agent, nixl_agent_config

        limit_ucx_to_interface_of(host)
        logging.getLogger("nixl").setLevel(logging.WARNING)  # its INFO lines go to stdout; ours say enough
        self.name = f"diptych-{role}-{os.getpid()}-{secrets.token_hex(4)}"
        self._agent = nixl_agent(self.name, nixl_agent_config(backends=["UCX"], enable_prog_thread=False))
        self._lock = threading.Lock()
        self._remotes: dict[bytes, str] = {}  # metadata → the remote agent's name, loaded once
        self._registered: set[int] = set()  # addresses of the pools registered

    def register(self, buffer: torch.Tensor) -> None:
        with self._lock:
            self._agent.register_memory(buffer)

    def register_once(self, memory: torch.Tensor) -> None:
        """Registers a KV pool (kept for the worker's life) the first time it is seen."""
        with self._lock:
            if memory.data_ptr() in self._registered:
                return
            self._agent.register_memory(memory)
            self._registered.add(memory.data_ptr())

    def has_registered(self, memory: torch.Tensor) -> bool:
        """Whether `register_once` registered this pool."""
        with self._lock:
            return memory.data_ptr() in self._registered

    def progress(self) -> None:
        with self._lock:
            self._agent.get_new_notifs()  # progresses the backend; writes here carry no notifications

    def metadata(self) -> bytes:
        with self._lock:
            return self._agent.get_agent_metadata()

    def write(self, local: list[memoryview], target: NixlTarget, offset: int, timeout: float) -> None:
        """Writes the regions of `local` (in memory this agent registered), one after another, from `offset`
        of the target's buffer; returns once they landed."""
        total = sum(len(region) for region in local)
        if offset < 0 or offset + total > target.size:
            raise KvTransferError(
                grpc.StatusCode.INTERNAL, "a KV chunk would land outside the decode worker's receive buffer"
            )
        remote = self._remote(target.metadata)
        places, at = [], target.address + offset
        for region in local:
            places.append((at, len(region), 0))
            at += len(region)
        with self._lock:
            local_descs = self._agent.get_xfer_descs([(address_of(r), len(r), 0) for r in local], "DRAM")
            remote_descs = self._agent.get_xfer_descs(places, "DRAM")
            handle = self._agent.initialize_xfer("WRITE", local_descs, remote_descs, remote)
            state = self._agent.transfer(handle)
        try:
            deadline = time.monotonic() + timeout
            while state == "PROC":
                if time.monotonic() > deadline:
                    raise KvTransferError(
                        grpc.StatusCode.DEADLINE_EXCEEDED, f"a NIXL write to {remote} did not complete in {timeout} s"
                    )
                time.sleep(0.0001)  # UCX's progress thread moves the bytes
                with self._lock:
                    state = self._agent.check_xfer_state(handle)
            if state != "DONE":
                raise KvTransferError(grpc.StatusCode.UNAVAILABLE, f"a NIXL write to {remote} failed")
        finally:
            with self._lock:
                self._agent.release_xfer_handle(handle)

    def _remote(self, metadata: bytes) -> str:
        with self._lock:
            name = self._remotes.get(metadata)
            if name is None:
                try:
                    name = self._agent.add_remote_agent(metadata)
                except Exception as error:  # NIXL raises its own exception types
                    raise KvTransferError(
                        grpc.StatusCode.UNAVAILABLE, f"the decode worker's NIXL agent cannot be reached: {error}"
                    ) from None
                name = name.decode() if isinstance(name, bytes) else str(name)
                self._remotes[metadata] = name
            return name


class RegisteredStaging(StagingPool):
    """Staging buffers registered with the agent as they are created, and kept for the worker's life
    (see the module's docstring for why they are never freed)."""

    def __init__(self, agent: NixlAgent, pin: bool = False) -> None:
        super().__init__(pin=pin, keep_bytes=1 << 62)
        self.agent = agent

    def _allocate(self, nbytes: int) -> torch.Tensor:
        buffer = super()._allocate(nbytes)
        self.agent.register(buffer)
        return buffer

    def target_of(self, buffer: torch.Tensor, nbytes: int) -> NixlTarget:
        return NixlTarget(self.agent.metadata(), buffer.data_ptr(), nbytes)


class NixlSend(BufferedSendPath):
    data_path = "nixl"

    def __init__(self, staging: RegisteredStaging, layout: KvLayout, nbytes: int, timeout: float) -> None:
        self._staging = staging
        self._timeout = timeout
        self._target: NixlTarget | None = None
        self._first_byte = 0  # the receive buffer starts at the first block sent
        super().__init__(staging.acquire(nbytes), layout)

    def after_hello(self, sock: socket.socket, first_block: int) -> None:
        reply = recv_json(sock, "the decode worker's NIXL target")
        check_reply(reply)
        self._target = NixlTarget.from_json(reply)
        self._first_byte = first_block * self._layout.block_nbytes

    def _deliver(self, sock: socket.socket, chunk: StagedChunk, start: int, data: memoryview) -> None:
        assert self._target is not None, "the target comes with the hello's answer"
        offset = start - self._first_byte
        self._staging.agent.write([data], self._target, offset, self._timeout)
        sock.sendall(chunk_frame(chunk.first_block, chunk.count, offset, checksum(data)))

    def _give_back(self) -> None:
        self._staging.release(self._buffer)


class NixlFromPool(FromPoolSendPath):
    """Chunks written straight out of a host-memory pool the agent registered once; a chunk copied out of
    the pool goes through a registered staging buffer (NIXL writes only from registered memory)."""

    data_path = "nixl"

    def __init__(self, staging: RegisteredStaging, layout: KvLayout, timeout: float) -> None:
        super().__init__()
        self._staging = staging
        self._layout = layout
        self._timeout = timeout
        self._target: NixlTarget | None = None
        self._first_byte = 0

    def _views_of(self, runner: KvSource, block_ids: list[int]) -> list[memoryview]:
        self._staging.agent.register_once(runner.pool_memory())
        return runner.block_views(block_ids)

    def after_hello(self, sock: socket.socket, first_block: int) -> None:
        reply = recv_json(sock, "the decode worker's NIXL target")
        check_reply(reply)
        self._target = NixlTarget.from_json(reply)
        self._first_byte = first_block * self._layout.block_nbytes

    def send(self, sock: socket.socket, chunk: StagedChunk) -> None:
        assert isinstance(chunk, PoolChunk) and self._target is not None, "the target comes with the hello's answer"
        offset = chunk.first_block * self._layout.block_nbytes - self._first_byte
        with chunk.lock:
            digest = xxhash.xxh3_64()
            for view in chunk.views:
                digest.update(view)
            self._staging.agent.write(chunk.views, self._target, offset, self._timeout)
            sock.sendall(chunk_frame(chunk.first_block, chunk.count, offset, digest.intdigest()))
            self.sent(chunk)

    def _copy_out(self, chunk: PoolChunk, data: bytes | memoryview) -> None:
        chunk.buffer = self._staging.acquire(len(data))
        view = chunk.buffer.numpy().data[: len(data)]
        view[:] = data
        chunk.views = [view]
        chunk.in_pool = False

    def _drop(self, chunk: PoolChunk) -> None:
        super()._drop(chunk)
        if chunk.buffer is not None:
            self._staging.release(chunk.buffer)
            chunk.buffer, chunk.views = None, []


class NixlReceive(ReceivePath):
    """The chunk is already in the receive buffer: its frame must say it landed where it belongs."""

    def __init__(self, buffer: torch.Tensor, agent: NixlAgent) -> None:
        self._address = buffer.data_ptr()
        self._agent = agent

    def wait_frame(self, conn: socket.socket) -> None:
        """Progresses the agent (so the sender's writes land) until a frame is there to read, for at most
        the connection's timeout; past it, reading the frame times out as on any path."""
        deadline = time.monotonic() + (conn.gettimeout() or 5.0)
        while not select.select([conn], [], [], 0.0005)[0] and time.monotonic() < deadline:
            self._agent.progress()

    @override
    def read(self, conn: socket.socket, target: memoryview, offset: int, what: str) -> None:
        if address_of(target) != self._address + offset:
            raise KvTransferError(
                grpc.StatusCode.INVALID_ARGUMENT, f"the frame of {what} names another place than where they belong"
            )


def address_of(view: memoryview) -> int:
    return int(np.frombuffer(view, dtype=np.uint8).ctypes.data)
