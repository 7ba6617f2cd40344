"""The KV receiver bounds what a peer costs before the peer proved anything: the hello's size and the
time it may take, the declared cache size against what the waiting request needs and the pool holds
(checked before any buffer is taken), and the number of open data connections."""

import json
import queue
import select
import socket
import struct
import tracemalloc

import grpc
import pytest
import torch

from tests.workers.kv_wire import LAYOUT, TOKEN, hello
from workers.kv_connector.receiver import KvInbox, KvReceiver
from workers.kv_connector.staging import StagingPool
from workers.kv_connector.timeouts import KvTimeouts
from workers.kv_connector.wire import FRAME, MAGIC, MAX_HELLO_BYTES, KvTransferError, checksum


class RecordingStaging(StagingPool):
    """A staging pool that remembers every buffer size asked of it."""

    def __init__(self) -> None:
        super().__init__()
        self.requested: list[int] = []

    def acquire(self, nbytes: int) -> torch.Tensor:
        self.requested.append(nbytes)
        return super().acquire(nbytes)


def make_receiver(hello_s: float = 5.0, **options) -> KvReceiver:
    timeouts = KvTimeouts(io_s=0.5, hello_s=hello_s, arrival_s=0.5)
    receiver = KvReceiver(KvInbox(timeouts), LAYOUT, timeouts=timeouts, staging=RecordingStaging(), **options)
    receiver.start()
    return receiver


@pytest.fixture
def receiver():
    rx = make_receiver(max_tokens=400)
    yield rx
    rx.close()


def connect(receiver) -> socket.socket:
    return socket.create_connection((receiver.host, receiver.port), timeout=5)


def reply(sock: socket.socket) -> dict:
    data = b""
    while len(data) < 4 or len(data) < 4 + struct.unpack("<I", data[:4])[0]:
        part = sock.recv(65536)
        assert part, f"the receiver closed without a reply (after {data!r})"
        data += part
    return json.loads(data[4:])


def closed(sock: socket.socket) -> bool:
    """True when the receiver closed the connection (perhaps after a reply)."""
    try:
        while part := sock.recv(65536):
            del part
        return True
    except ConnectionResetError:
        return True


def test_a_hello_longer_than_its_bound_is_refused_before_it_is_read():
    receiver = make_receiver()
    try:
        tracemalloc.start()
        with connect(receiver) as sock:
            claimed = 8 << 20  # an old receiver took up to 16 MiB of header on trust
            sock.sendall(MAGIC + struct.pack("<I", claimed))
            answer = reply(sock)
        _, peak = tracemalloc.get_traced_memory()
        tracemalloc.stop()
    finally:
        receiver.close()
    assert answer["code"] == "INVALID_ARGUMENT"
    assert f"({claimed} bytes; at most {MAX_HELLO_BYTES})" in answer["error"]
    assert peak < claimed // 4, f"{peak} bytes were allocated for a hello that was refused"


def test_a_cache_larger_than_its_request_is_refused_without_a_buffer(receiver):
    arrived = queue.Queue()
    receiver.inbox.expect("req-1", TOKEN, arrived.put, 20)
    with connect(receiver) as sock:
        sock.sendall(hello(num_tokens=10_000_000))  # 10 M tokens: 2.5 GB of KV in this layout
        answer = reply(sock)
    assert answer["code"] == "INVALID_ARGUMENT"
    assert "declares 10000000 tokens" in answer["error"] and "a prompt of 20" in answer["error"]
    error = arrived.get(timeout=5)  # the decode request learns it at once
    assert isinstance(error, KvTransferError) and error.code is grpc.StatusCode.INVALID_ARGUMENT
    assert receiver.staging.requested == []


def test_a_cache_larger_than_the_pool_is_refused_without_a_buffer(receiver):
    arrived = queue.Queue()
    receiver.inbox.expect("req-1", TOKEN, arrived.put, 100_000)  # the request claims more than the pool
    with connect(receiver) as sock:
        sock.sendall(hello(num_tokens=50_000))
        answer = reply(sock)
    assert answer["code"] == "RESOURCE_EXHAUSTED" and "KV pool (400 tokens)" in answer["error"]
    assert isinstance(arrived.get(timeout=5), KvTransferError)
    assert receiver.staging.requested == []


def test_a_size_is_not_even_considered_without_the_transfer_token(receiver):
    arrived = queue.Queue()
    receiver.inbox.expect("req-1", TOKEN, arrived.put, 20)
    with connect(receiver) as sock:
        sock.sendall(hello(num_tokens=10_000_000, transfer_token=(b"x" * 32).hex()))
        answer = reply(sock)
    assert answer["code"] == "PERMISSION_DENIED" and "token does not match" in answer["error"]
    assert receiver.staging.requested == [] and arrived.empty()  # the request still waits for its KV


def test_connections_beyond_the_limit_are_refused_and_idle_ones_closed_after_the_hello_timeout():
    receiver = make_receiver(max_connections=3, hello_s=0.5)
    idle = [connect(receiver) for _ in range(3)]
    try:
        with connect(receiver) as extra:
            answer = reply(extra)
        assert answer["code"] == "RESOURCE_EXHAUSTED" and "KV connections" in answer["error"]
        assert receiver.connections_refused == 1
        for sock in idle:  # none of them sent a hello in time: each is told so and closed
            assert reply(sock)["code"] == "DEADLINE_EXCEEDED"
            assert closed(sock)
        with connect(receiver) as again:  # their places are free again
            again.sendall(b"NOPE")
            assert "not a Diptych KV stream" in reply(again)["error"]
    finally:
        for sock in idle:
            sock.close()
        receiver.close()


def test_a_hello_trickled_byte_by_byte_is_cut_off_at_the_hello_timeout():
    """Each byte comes well within the idle timeout; the hello as a whole must still arrive in time."""
    receiver = make_receiver(hello_s=0.5)
    try:
        data = hello(num_tokens=8)
        with connect(receiver) as sock:
            answered = None
            for index in range(len(data)):
                sock.sendall(data[index : index + 1])
                if select.select([sock], [], [], 0.1)[0]:
                    answered = index
                    break
            assert answered is not None and answered < len(data) - 1, "the whole trickled hello was read"
            assert reply(sock)["code"] == "DEADLINE_EXCEEDED"
    finally:
        receiver.close()


def test_an_accepted_cache_takes_one_buffer_of_its_own_size(receiver):
    """The bounds leave a legitimate transfer alone: a 10-token prompt gets 3 blocks' worth."""
    arrived = queue.Queue()
    receiver.inbox.expect("req-1", TOKEN, arrived.put, 10)
    payload = torch.randn(3 * LAYOUT.block_nbytes // 4).numpy().tobytes()
    with connect(receiver) as sock:
        sock.sendall(hello(num_tokens=10))
        assert reply(sock) == {"ok": True}
        sock.sendall(struct.pack("<10I", *range(10)))
        sock.sendall(FRAME.pack(b"C", 0, 3, 0, checksum(payload)) + payload + FRAME.pack(b"E", 7, 0, 0, 0))
        assert reply(sock)["ok"]
    received = arrived.get(timeout=5)
    assert received.prompt_token_ids == list(range(10)) and received.first_token_id == 7
    assert receiver.staging.requested == [3 * LAYOUT.block_nbytes]
    received.release()


@pytest.mark.parametrize(
    ("field", "value", "complaint"),
    [
        ("request_id", ["req-1"], "request_id must be a short string"),
        ("request_id", {"id": "req-1"}, "request_id must be a short string"),
        ("request_id", "r" * 10_000, None),  # too long for the hello's bound, or for a request id
        ("num_tokens", "12", "num_tokens must be an integer"),
        ("num_tokens", True, "num_tokens must be an integer"),
        ("transfer_token", ["ab"], "transfer_token must be hex"),
        ("transfer_token", "not hex", "transfer_token must be hex"),
        ("data_path", ["tcp"], "no known data path"),
        ("segment", {"name": "x"}, "segment and traceparent are strings"),
    ],
)
def test_a_hello_with_a_field_of_the_wrong_type_is_refused_as_malformed_without_a_traceback(
    receiver, caplog, field, value, complaint
):
    arrived = queue.Queue()
    receiver.inbox.expect("req-1", TOKEN, arrived.put, 20)
    with caplog.at_level("ERROR", logger="workers.kv_connector.receiver"), connect(receiver) as sock:
        sock.sendall(hello(**{"num_tokens": 8, field: value}))
        answer = reply(sock)
    assert answer["code"] == "INVALID_ARGUMENT"
    assert complaint is None or complaint in answer["error"]
    assert not [r for r in caplog.records if r.exc_info], "a malformed hello logged a traceback"
    assert receiver.staging.requested == [] and arrived.empty()  # the waiting request is not disturbed
