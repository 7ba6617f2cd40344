"""The KV data path: a cache arrives whole and identical over TCP or shared memory, and every bad
transfer (wrong token, corrupt or cut-off data, a stalled peer) fails with a clear error on both sides
and never hands a half-received cache to decode."""

import json
import os
import queue
import socket
import struct
import subprocess
import sys
import threading
import time

import grpc
import pytest
import torch

from diptych_common.proto.v1 import worker_pb2
from tests.workers.kv_wire import LAYOUT, TOKEN, hello
from workers.engine.kv_transfer import Peer
from workers.kv_connector import shm
from workers.kv_connector.receiver import KvInbox, KvReceiver, ReceivedKv
from workers.kv_connector.sender import KvSender, peer_from_endpoint
from workers.kv_connector.staging import StagingPool
from workers.kv_connector.timeouts import KvTimeouts
from workers.kv_connector.wire import FRAME, KvTransferError, checksum
from workers.runner.kv_pool import BlocksRead
from workers.runner.model_runner import ModelRunner

TIMEOUTS = KvTimeouts(io_s=0.5, arrival_s=0.5, hello_answer_s=1.5)  # both sides of the tests' transfers


class PoolRunner:
    def __init__(self) -> None:
        self.kv = torch.randn(2, 2, 20, 4, 2, 8, generator=torch.Generator().manual_seed(0))

    layout = LAYOUT
    block_views = ModelRunner.block_views
    pool_memory = ModelRunner.pool_memory
    supports_block_views = True  # a host-memory pool

    def read_blocks(self, block_ids, out) -> None:
        torch.index_select(self.kv, 2, torch.tensor(block_ids), out=out)

    def start_reading_blocks(self, block_ids, out) -> BlocksRead:
        self.read_blocks(block_ids, out)
        return BlocksRead()  # a host pool: the copy is done


@pytest.fixture
def receiver():
    rx = KvReceiver(KvInbox(TIMEOUTS), LAYOUT, timeouts=TIMEOUTS)
    rx.start()
    yield rx
    rx.close()


@pytest.fixture
def sender():
    tx = KvSender(LAYOUT, TIMEOUTS)
    yield tx
    tx.close()


def expect(receiver, request_id="req-1", token=TOKEN, max_tokens=64) -> queue.Queue:
    arrived = queue.Queue()
    receiver.inbox.expect(request_id, token, arrived.put, max_tokens)
    return arrived


def send_in_background(outgoing) -> queue.Queue:
    result = queue.Queue()

    def run():
        try:
            result.put(outgoing.send())
        except KvTransferError as error:
            result.put(error)

    threading.Thread(target=run, daemon=True).start()
    return result


def taken_by_the_transfer(outgoing, timeout: float = 5.0) -> bool:
    """Whether the transfer's thread took every chunk staged so far, within `timeout`."""
    deadline = time.monotonic() + timeout
    while not outgoing._events.empty():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.002)
    return True


def idle_receive_buffers(receiver) -> int:
    return receiver.staging.num_idle


@pytest.mark.parametrize(
    ("same_host", "from_pool"),
    [(False, True), (False, False), (True, False)],
    ids=["tcp-from-pool", "tcp-from-staging-buffer", "shm"],
)
def test_a_cache_staged_chunk_by_chunk_arrives_whole_and_identical(receiver, sender, same_host, from_pool):
    sender.send_from_pool = from_pool  # False: as with a GPU pool, chunks are copied to host buffers first
    runner = PoolRunner()
    arrived = expect(receiver)
    outgoing = sender.open("req-1", TOKEN, list(range(3, 13)), Peer(receiver.host, receiver.port, same_host))
    result = send_in_background(outgoing)
    outgoing.write_blocks(runner, [7, 2], 0)
    assert taken_by_the_transfer(outgoing)  # the first chunk leaves while "compute" goes on
    outgoing.write_blocks(runner, [11], 2)
    outgoing.finish(42)
    assert result.get(timeout=5) == 3 * LAYOUT.block_nbytes  # whole blocks, the last one partly filled
    received = arrived.get(timeout=5)
    assert isinstance(received, ReceivedKv)
    assert received.data_path == ("shm" if same_host else "tcp")
    assert received.prompt_token_ids == list(range(3, 13)) and received.first_token_id == 42
    assert received.num_tokens == 10 and [chunk.first_block for chunk in received.chunks] == [0, 2]
    whole = torch.cat([chunk.data for chunk in received.chunks], dim=2)
    assert torch.equal(whole, runner.kv[:, :, [7, 2, 11]])
    received.release()
    assert receiver.bytes_received == sender.bytes_sent == 3 * LAYOUT.block_nbytes


def test_a_wrong_token_is_refused_on_both_sides_and_the_request_keeps_waiting(receiver, sender):
    arrived = expect(receiver)
    outgoing = sender.open("req-1", b"x" * 32, [1, 2, 3], Peer(receiver.host, receiver.port, False))
    result = send_in_background(outgoing)
    error = result.get(timeout=5)
    assert isinstance(error, KvTransferError) and error.code is grpc.StatusCode.PERMISSION_DENIED
    assert "token does not match" in str(error)
    assert arrived.empty()
    good = sender.open("req-1", TOKEN, [1, 2, 3], Peer(receiver.host, receiver.port, False))
    result = send_in_background(good)
    good.write_blocks(PoolRunner(), [0], 0)
    good.finish(5)
    assert result.get(timeout=5) == LAYOUT.block_nbytes
    assert isinstance(arrived.get(timeout=5), ReceivedKv)


def test_a_token_works_once(receiver, sender):
    arrived = expect(receiver)
    for _ in range(2):
        outgoing = sender.open("req-1", TOKEN, [1], Peer(receiver.host, receiver.port, False))
        result = send_in_background(outgoing)
        outgoing.write_blocks(PoolRunner(), [0], 0)
        outgoing.finish(5)
        outcome = result.get(timeout=5)
    assert isinstance(outcome, KvTransferError) and outcome.code is grpc.StatusCode.PERMISSION_DENIED
    assert "already sent" in str(outcome)
    assert isinstance(arrived.get(timeout=5), ReceivedKv) and arrived.empty()


def test_a_transfer_nobody_waits_for_is_refused_quickly(receiver, sender):
    outgoing = sender.open("req-9", TOKEN, [1], Peer(receiver.host, receiver.port, False))
    started = time.monotonic()
    error = send_in_background(outgoing).get(timeout=5)
    assert error.code is grpc.StatusCode.FAILED_PRECONDITION and "req-9" in str(error)
    assert time.monotonic() - started < 3


class HandSender:
    """Speaks the wire protocol by hand, to send what a correct sender never would."""

    def __init__(self, receiver, num_tokens=8, **header) -> None:
        self.sock = socket.create_connection((receiver.host, receiver.port), timeout=5)
        self.num_tokens = num_tokens
        self.prompt_sent = False
        self.sock.sendall(hello(num_tokens, **header))

    def reply(self) -> dict:
        """The next reply; once the hello is accepted, the prompt's token ids follow, as a sender's do."""
        (length,) = struct.unpack("<I", self._exact(4))
        message = json.loads(self._exact(length))
        if message["ok"] and not self.prompt_sent:
            self.sock.sendall(struct.pack(f"<{self.num_tokens}I", *range(self.num_tokens)))
            self.prompt_sent = True
        return message

    def _exact(self, count: int) -> bytes:
        data = b""
        while len(data) < count:
            part = self.sock.recv(count - len(data))
            assert part, "the receiver closed without a reply"
            data += part
        return data

    def chunk(self, first: int, payload: bytes, digest: int | None = None) -> None:
        count = len(payload) // LAYOUT.block_nbytes
        self.sock.sendall(FRAME.pack(b"C", first, count, 0, checksum(payload) if digest is None else digest) + payload)


def block_bytes(count: int) -> bytes:
    return torch.randn(count * LAYOUT.block_nbytes // 4).numpy().tobytes()


def assert_refused(arrived, code, match):
    error = arrived.get(timeout=5)
    assert isinstance(error, KvTransferError), "a broken transfer must never deliver a cache"
    assert error.code is code and match in str(error)


def test_corrupt_data_is_refused_on_both_sides(receiver):
    arrived = expect(receiver)
    idle_before = idle_receive_buffers(receiver)
    hand = HandSender(receiver)
    assert hand.reply() == {"ok": True}
    payload = block_bytes(2)
    hand.chunk(0, payload, digest=checksum(payload) ^ 1)
    assert hand.reply() == {"ok": False, "code": "DATA_LOSS", "error": "KV blocks 0..1 failed their checksum"}
    assert_refused(arrived, grpc.StatusCode.DATA_LOSS, "checksum")
    assert idle_receive_buffers(receiver) == idle_before + 1  # its buffer went back, unused


def test_a_cut_off_stream_is_never_delivered(receiver):
    arrived = expect(receiver)
    hand = HandSender(receiver)
    hand.reply()
    payload = block_bytes(2)
    hand.sock.sendall(FRAME.pack(b"C", 0, 2, 0, checksum(payload)) + payload[: len(payload) // 2])
    hand.sock.close()
    assert_refused(arrived, grpc.StatusCode.DATA_LOSS, "cut off")


def test_an_early_end_is_never_delivered(receiver):
    arrived = expect(receiver)
    hand = HandSender(receiver, num_tokens=12)  # three blocks
    hand.reply()
    hand.chunk(0, block_bytes(2))
    hand.sock.sendall(FRAME.pack(b"E", 9, 0, 0, 0))
    assert hand.reply()["code"] == "DATA_LOSS"
    assert_refused(arrived, grpc.StatusCode.DATA_LOSS, "after 2 of 3 blocks")


def test_a_stalled_sender_times_out_with_a_clear_error(receiver):
    arrived = expect(receiver)
    hand = HandSender(receiver)
    hand.reply()
    started = time.monotonic()
    assert_refused(arrived, grpc.StatusCode.DEADLINE_EXCEEDED, "stalled")
    assert time.monotonic() - started < 3
    assert hand.reply()["code"] == "DEADLINE_EXCEEDED"


def test_a_silent_receiver_times_out_on_the_sender(sender):
    silent = socket.create_server(("127.0.0.1", 0))
    try:
        outgoing = sender.open("req-1", TOKEN, [1], Peer("127.0.0.1", silent.getsockname()[1], False))
        started = time.monotonic()
        error = send_in_background(outgoing).get(timeout=5)
        assert error.code is grpc.StatusCode.DEADLINE_EXCEEDED and "stalled" in str(error)
        assert time.monotonic() - started < 3
    finally:
        silent.close()


def test_a_closed_data_port_is_unavailable(sender):
    port = socket.create_server(("127.0.0.1", 0))
    address = port.getsockname()
    port.close()
    outgoing = sender.open("req-1", TOKEN, [1], Peer(*address, False))
    error = send_in_background(outgoing).get(timeout=5)
    assert error.code is grpc.StatusCode.UNAVAILABLE and str(address[1]) in str(error)


def test_an_aborted_transfer_reaches_the_receiver_with_its_reason(receiver, sender):
    arrived = expect(receiver)
    outgoing = sender.open("req-1", TOKEN, [1, 2, 3, 4, 5], Peer(receiver.host, receiver.port, False))
    result = send_in_background(outgoing)
    outgoing.write_blocks(PoolRunner(), [0], 0)
    outgoing.abort("the prefill request was cancelled")
    assert result.get(timeout=5).code is grpc.StatusCode.ABORTED
    assert_refused(arrived, grpc.StatusCode.ABORTED, "the prefill request was cancelled")


@pytest.mark.parametrize(
    ("header", "match"),
    [
        ({"block_size": 8}, "does not match"),
        ({"data_path": "pigeon"}, "no known data path"),
        ({"segment": "../etc/passwd", "data_path": "shm"}, "not a KV segment name"),
    ],
)
def test_a_bad_header_is_refused_with_the_reason(receiver, header, match):
    arrived = expect(receiver)
    hand = HandSender(receiver, **header)
    if "segment" in header:
        assert hand.reply() == {"ok": True}
        hand.chunk(0, block_bytes(2))
    reply = hand.reply()
    assert not reply["ok"] and match in reply["error"]
    if "segment" in header:
        assert_refused(arrived, grpc.StatusCode.INVALID_ARGUMENT, match)
    else:
        assert arrived.empty()


def test_a_peer_is_same_host_only_when_its_probe_file_is_readable(receiver):
    endpoint = worker_pb2.KvEndpoint(
        data_host="",
        data_port=receiver.port,
        shm_probe_name=receiver.shm_probe_name,
        shm_probe_nonce=receiver.shm_probe_nonce,
        block_size=4,
        dtype="float32",
    )
    assert peer_from_endpoint("127.0.0.1:5000", endpoint, LAYOUT) == Peer("127.0.0.1", receiver.port, True)
    endpoint.shm_probe_nonce = b"another host's nonce"
    assert not peer_from_endpoint("127.0.0.1:5000", endpoint, LAYOUT).same_host
    endpoint.block_size = 16
    with pytest.raises(KvTransferError, match="blocks of 16 tokens"):
        peer_from_endpoint("127.0.0.1:5000", endpoint, LAYOUT)


def test_shared_memory_segments_are_reused_and_removed_on_close():
    segments = shm.SharedSegments()
    first = segments.acquire(3 << 20)
    segments.release(first)
    assert segments.acquire(2 << 20) is first
    path = os.path.join(shm.SHM_DIR, first.name)
    assert os.path.exists(path)
    segments.close()
    assert not os.path.exists(path)


def test_staging_buffers_of_any_sizes_are_reused_by_identity():
    pool = StagingPool(keep_bytes=8 << 20)
    small, large = pool.acquire(1 << 20), pool.acquire(3 << 20)
    pool.release(small)
    pool.release(large)
    assert pool.acquire(2 << 20) is large and pool.acquire(1 << 20) is small


def test_blocks_handed_over_from_the_pool_survive_their_reuse(receiver, sender):
    blocks_survive_their_reuse(receiver, sender, Peer(receiver.host, receiver.port, False))


def blocks_survive_their_reuse(receiver, sender, peer: Peer) -> None:
    """A finished request's blocks may be overwritten by the next step: wait_sent copies out what the
    transfer has not sent yet (here it is still waiting for its hello to be answered), at once."""
    runner = PoolRunner()
    original = runner.kv[:, :, [3, 4]].clone()
    outgoing = sender.open("req-1", TOKEN, list(range(8)), peer)
    result = send_in_background(outgoing)
    outgoing.write_blocks(runner, [3, 4], 0)
    outgoing.finish(9)
    started = time.monotonic()
    outgoing.wait_sent()
    assert time.monotonic() - started < 0.2
    runner.kv[:, :, 3:5] = 0.0  # the blocks are reused
    arrived = expect(receiver)  # the decode request registers only now
    assert result.get(timeout=10) == 2 * LAYOUT.block_nbytes
    received = arrived.get(timeout=10)
    assert torch.equal(received.chunks[0].data, original)
    received.release()


def test_files_left_by_dead_processes_are_swept_and_live_ones_kept(receiver):
    dead = subprocess_pid_that_exited()
    stale = os.path.join(shm.SHM_DIR, f"{shm.SHM_PREFIX}{dead}-1-abcd")
    stale_probe = os.path.join(shm.SHM_DIR, f"{shm.SHM_PREFIX}probe-{dead}-abcd")
    for path in (stale, stale_probe):
        open(path, "wb").close()
    assert shm.sweep_stale_files() >= 2
    assert not os.path.exists(stale) and not os.path.exists(stale_probe)
    assert os.path.exists(os.path.join(shm.SHM_DIR, receiver.shm_probe_name))  # ours: alive


def subprocess_pid_that_exited() -> int:
    process = subprocess.Popen([sys.executable, "-c", "pass"])
    process.wait()
    return process.pid


def test_idle_segments_beyond_the_limit_are_removed():
    segments = shm.SharedSegments(keep_bytes=4 << 20)
    small, large = segments.acquire(1 << 20), segments.acquire(4 << 20)
    segments.release(large)
    segments.release(small)  # 5 MiB idle > 4 MiB: the smallest goes
    assert not os.path.exists(os.path.join(shm.SHM_DIR, small.name))
    assert os.path.exists(os.path.join(shm.SHM_DIR, large.name))
    segments.close()
    assert not os.path.exists(os.path.join(shm.SHM_DIR, large.name))
