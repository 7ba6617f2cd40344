"""The NIXL data path over UCX on loopback: a cache written one-sided by the prefill worker arrives whole
and identical, the decode worker's receive buffer is named to nobody before the transfer token checks out,
a frame that names another place than where its blocks belong is refused, and the path is chosen only
where both sides run an agent (shared memory still serves one host)."""

import json
import os
import queue
import socket
import struct

import grpc
import pytest
import torch

from tests.listening_sockets import listening_sockets, non_loopback_addresses_exist
from tests.workers.kv_wire import LAYOUT, TOKEN, hello
from tests.workers.test_kv_transfer import (
    PoolRunner,
    blocks_survive_their_reuse,
    expect,
    send_in_background,
    taken_by_the_transfer,
)
from workers.engine.kv_transfer import Peer
from workers.kv_connector.interfaces import LOOPBACK, interface_addresses
from workers.kv_connector.nixl import NixlFromPool, NixlSend, RegisteredStaging, nixl_staging
from workers.kv_connector.receiver import KvInbox, KvReceiver, ReceivedKv
from workers.kv_connector.sender import KvSender
from workers.kv_connector.shm import ShmSend
from workers.kv_connector.tcp import TcpFromPool
from workers.kv_connector.timeouts import KvTimeouts
from workers.kv_connector.wire import FRAME, KvTransferError, recv_json

TIMEOUTS = KvTimeouts(io_s=2.0, arrival_s=0.5, hello_answer_s=1.5)  # both sides of the tests' transfers


@pytest.fixture(scope="module")
def decode_agent() -> RegisteredStaging:
    staging = nixl_staging("on", "decode", LOOPBACK)
    assert staging is not None
    return staging


@pytest.fixture(scope="module")
def prefill_agent() -> RegisteredStaging:
    staging = nixl_staging("on", "prefill", LOOPBACK)
    assert staging is not None
    return staging


@pytest.fixture
def receiver(decode_agent):
    rx = KvReceiver(KvInbox(TIMEOUTS), LAYOUT, timeouts=TIMEOUTS, nixl=decode_agent)
    rx.start()
    yield rx
    rx.close()


@pytest.fixture
def sender(prefill_agent):
    tx = KvSender(LAYOUT, TIMEOUTS, nixl=prefill_agent)
    yield tx
    tx.close()


def nixl_peer(receiver) -> Peer:
    return Peer(receiver.host, receiver.port, same_host=False, nixl=True)


def test_a_cache_written_chunk_by_chunk_arrives_whole_and_identical(receiver, sender):
    runner = PoolRunner()
    arrived = expect(receiver)
    outgoing = sender.open("req-1", TOKEN, list(range(3, 13)), nixl_peer(receiver))
    assert outgoing.data_path == "nixl"
    result = send_in_background(outgoing)
    outgoing.write_blocks(runner, [7, 2], 0)
    assert taken_by_the_transfer(outgoing)  # the first chunk leaves while "compute" goes on
    outgoing.write_blocks(runner, [11], 2)
    outgoing.finish(42)
    assert result.get(timeout=10) == 3 * LAYOUT.block_nbytes
    received = arrived.get(timeout=10)
    assert isinstance(received, ReceivedKv), received
    assert received.data_path == "nixl" and received.first_token_id == 42
    whole = torch.cat([chunk.data for chunk in received.chunks], dim=2)
    assert torch.equal(whole, runner.kv[:, :, [7, 2, 11]])
    received.release()
    assert receiver.bytes_received == sender.bytes_sent == 3 * LAYOUT.block_nbytes


def test_only_the_blocks_the_decode_worker_lacks_are_written(receiver, sender):
    runner = PoolRunner()
    prompt = list(range(3, 15))  # 12 tokens: 3 blocks, the decode worker holds the first 2
    arrived = queue.Queue()
    receiver.inbox.expect("req-1", TOKEN, arrived.put, len(prompt), held_blocks=2, prompt_token_ids=tuple(prompt))
    outgoing = sender.open("req-1", TOKEN, prompt, nixl_peer(receiver))
    result = send_in_background(outgoing)
    outgoing.write_blocks(runner, [5], 0)  # staged before the answer came: dropped once it says 2 are held
    outgoing.write_blocks(runner, [6], 1)
    outgoing.write_blocks(runner, [9], 2)
    outgoing.finish(7)
    assert result.get(timeout=10) == LAYOUT.block_nbytes
    received = arrived.get(timeout=10)
    assert isinstance(received, ReceivedKv), received
    assert received.first_block == 2 and [chunk.first_block for chunk in received.chunks] == [2]
    assert torch.equal(received.chunks[0].data, runner.kv[:, :, [9]])
    received.release()


def test_a_decode_worker_without_an_agent_refuses_a_nixl_hello_on_both_sides(sender):
    timeouts = KvTimeouts(io_s=1.0, arrival_s=0.5)
    rx = KvReceiver(KvInbox(timeouts), LAYOUT, timeouts=timeouts)  # no NIXL agent
    rx.start()
    try:
        arrived = expect(rx)
        outgoing = sender.open("req-1", TOKEN, [1, 2, 3], nixl_peer(rx))
        result = send_in_background(outgoing)
        outgoing.write_blocks(PoolRunner(), [0], 0)
        outgoing.finish(5)
        error = result.get(timeout=10)
        assert isinstance(error, KvTransferError) and error.code is grpc.StatusCode.FAILED_PRECONDITION
        assert "runs no NIXL agent" in str(error)
        delivered = arrived.get(timeout=5)
        assert isinstance(delivered, KvTransferError) and "runs no NIXL agent" in str(delivered)
    finally:
        rx.close()


def test_the_receive_buffer_is_named_only_after_the_transfer_token_checks_out(receiver):
    expect(receiver)
    with socket.create_connection((receiver.host, receiver.port), timeout=5) as sock:
        sock.sendall(hello(4, data_path="nixl", transfer_token=(b"x" * 32).hex(), skip_held=False))
        reply = recv_json(sock, "the reply")
    assert reply["ok"] is False and reply["code"] == "PERMISSION_DENIED"
    assert "nixl_metadata" not in json.dumps(reply) and "address" not in reply


def test_a_frame_that_names_another_place_is_refused_and_never_delivered(receiver, decode_agent, prefill_agent):
    arrived = expect(receiver)
    with socket.create_connection((receiver.host, receiver.port), timeout=5) as sock:
        sock.sendall(hello(8, data_path="nixl"))
        assert recv_json(sock, "the reply")["ok"] is True
        sock.sendall(struct.pack("<8I", *range(8)))
        target = recv_json(sock, "the target")
        assert target["ok"] is True and target["size"] == 2 * LAYOUT.block_nbytes
        # the second block's frame, claiming the first block's place
        sock.sendall(FRAME.pack(b"C", 0, 1, LAYOUT.block_nbytes, 0))
        reply = recv_json(sock, "the verdict")
    assert reply["ok"] is False and reply["code"] == "INVALID_ARGUMENT"
    delivered = arrived.get(timeout=5)
    assert isinstance(delivered, KvTransferError) and "another place" in str(delivered)


def test_receive_buffers_stay_registered_and_are_reused_never_freed(receiver, sender):
    before = receiver.nixl.num_idle
    for request in ("req-a", "req-b"):
        arrived = expect(receiver, request_id=request)
        outgoing = sender.open(request, TOKEN, [1, 2, 3], nixl_peer(receiver))
        result = send_in_background(outgoing)
        outgoing.write_blocks(PoolRunner(), [4], 0)
        outgoing.finish(9)
        assert result.get(timeout=10) == LAYOUT.block_nbytes
        received = arrived.get(timeout=10)
        received.release()
    assert receiver.nixl.num_idle == max(before, 1)  # one buffer served both, and is kept
    assert receiver.staging.num_idle == 0  # the TCP staging pool was never touched


def test_the_path_is_nixl_only_where_both_sides_run_an_agent(receiver, sender, prefill_agent):
    nbytes = LAYOUT.block_nbytes
    assert isinstance(sender.path_to(nixl_peer(receiver), nbytes), NixlFromPool)  # a host-memory pool
    from_device = KvSender(LAYOUT, pin=True, nixl=prefill_agent)  # a GPU pool: through a registered buffer
    assert isinstance(from_device.path_to(nixl_peer(receiver), nbytes), NixlSend)
    assert isinstance(sender.path_to(Peer(receiver.host, receiver.port, True, nixl=True), nbytes), ShmSend)
    assert isinstance(sender.path_to(Peer(receiver.host, receiver.port, False), nbytes), TcpFromPool)
    without = KvSender(LAYOUT)
    assert isinstance(without.path_to(nixl_peer(receiver), nbytes), TcpFromPool)


def test_nixl_off_runs_no_agent_and_on_fails_without_nixl(monkeypatch):
    assert nixl_staging("off", "decode", LOOPBACK) is None
    monkeypatch.setattr("workers.kv_connector.nixl.nixl_unavailable", lambda: "not here")
    assert nixl_staging("auto", "decode", LOOPBACK) is None
    with pytest.raises(RuntimeError, match="not here"):
        nixl_staging("on", "decode", LOOPBACK)


def test_a_worker_told_to_use_nixl_where_there_is_none_refuses_to_start_with_the_reason(monkeypatch):
    from diptych_server import cli

    monkeypatch.setattr("workers.kv_connector.nixl.nixl_unavailable", lambda: "NIXL is not installed here")
    with pytest.raises(SystemExit, match="--kv-nixl on: NIXL is not installed here"):
        cli.main(["worker", "--role", "decode", "--kv-nixl", "on"])


def arrives_whole(receiver, sender, runner, request_id: str, block_ids: list[int]) -> None:
    """The blocks, written over NIXL as one chunk, arrive identical."""
    arrived = expect(receiver, request_id)
    outgoing = sender.open(request_id, TOKEN, list(range(3, 11)), nixl_peer(receiver))
    result = send_in_background(outgoing)
    outgoing.write_blocks(runner, block_ids, 0)
    outgoing.finish(7)
    assert result.get(timeout=10) == len(block_ids) * LAYOUT.block_nbytes
    received = arrived.get(timeout=10)
    assert torch.equal(received.chunks[0].data, runner.kv[:, :, block_ids])
    received.release()


def test_chunks_are_written_from_the_pool_the_agent_registered(receiver, sender, prefill_agent):
    runner = PoolRunner()
    idle_before = prefill_agent.num_idle
    for request_id in ("req-1", "req-2"):
        arrives_whole(receiver, sender, runner, request_id, [5, 6])
    assert prefill_agent.agent.has_registered(runner.kv)
    assert prefill_agent.num_idle == idle_before  # written in place: no staging buffer was taken


def test_blocks_written_from_the_pool_survive_their_reuse_and_the_copy_goes_back(receiver, sender, prefill_agent):
    idle_before = prefill_agent.num_idle
    blocks_survive_their_reuse(receiver, sender, nixl_peer(receiver))  # copied into a registered buffer
    assert prefill_agent.num_idle == max(idle_before, 1)  # which came back once the chunk was written


class SpreadRunner(PoolRunner):
    """A pool that cannot be seen in place (a tensor-parallel runner's is spread over processes)."""

    supports_block_views = False


def test_a_pool_that_cannot_be_seen_in_place_is_copied_into_a_registered_buffer(receiver, sender):
    arrives_whole(receiver, sender, SpreadRunner(), "req-1", [9, 1])


@pytest.mark.skipif(not non_loopback_addresses_exist(), reason="this host has no address beyond loopback to avoid")
@pytest.mark.parametrize("role", ["prefill", "decode"])
def test_an_agent_for_a_loopback_worker_listens_and_advertises_only_loopback(role):
    before = listening_sockets(os.getpid())
    staging = nixl_staging("on", role, LOOPBACK)
    assert staging is not None
    staging.agent.register(torch.zeros(1 << 16, dtype=torch.uint8))  # as a worker's first transfer does
    opened = listening_sockets(os.getpid()) - before
    assert opened, "UCX opened no listener: this test would see nothing"
    assert {address for address, _ in opened} <= {"127.0.0.1", "::1"}, opened
    metadata = staging.agent.metadata()
    for name, address in interface_addresses():
        if not address.is_loopback:
            assert address.packed not in metadata, f"the agent advertises {name}'s {address}"


def test_an_address_no_interface_holds_is_refused_before_ucx_starts():
    with pytest.raises(ValueError, match=r"no network interface of this host holds 203.0.113.9"):
        nixl_staging("on", "decode", "203.0.113.9")
