"""The KV hand-off's receiving side: only the right token, only a complete and intact cache."""

import asyncio

import grpc
import pytest
import torch

from workers import kv_transfer
from workers.kv_cache import SequenceKV
from workers.kv_transfer import KvInbox, KvTransferError, kv_chunks

TOKEN = b"t" * 32


def sequence_kv(length: int = 9, layers: int = 3) -> SequenceKV:
    generator = torch.Generator().manual_seed(0)
    return SequenceKV([
        (torch.randn(2, length, 8, generator=generator), torch.randn(2, length, 8, generator=generator))
        for _ in range(layers)
    ])


async def as_stream(chunks):
    for chunk in chunks:
        yield chunk


async def test_a_pushed_cache_arrives_whole_and_identical():
    kv = sequence_kv()
    inbox = KvInbox()
    arrival = inbox.expect("req-1", TOKEN)
    nbytes = await inbox.receive(as_stream(kv_chunks("req-1", TOKEN, [4, 5, 6], 42, kv)))
    received = await arrival
    assert nbytes == kv.nbytes == inbox.bytes_received
    assert received.prompt_token_ids == [4, 5, 6] and received.first_token_id == 42
    for (k, v), (rk, rv) in zip(kv.layers, received.kv.layers):
        assert torch.equal(k, rk) and torch.equal(v, rv)


async def test_large_tensors_are_split_into_bounded_chunks_and_reassembled(monkeypatch):
    monkeypatch.setattr(kv_transfer, "CHUNK_BYTES", 100)
    kv = sequence_kv(length=20, layers=2)
    chunks = list(kv_chunks("req-1", TOKEN, [1], 2, kv))
    assert max(len(c.tensor.data) for c in chunks if c.HasField("tensor")) == 100
    inbox = KvInbox()
    arrival = inbox.expect("req-1", TOKEN)
    await inbox.receive(as_stream(chunks))
    assert torch.equal((await arrival).kv.layers[1][1], kv.layers[1][1])


async def test_a_push_may_arrive_before_the_decode_request_registers():
    inbox = KvInbox(arrival_timeout=2.0)
    push = asyncio.create_task(inbox.receive(as_stream(kv_chunks("req-1", TOKEN, [1], 2, sequence_kv()))))
    await asyncio.sleep(0.05)
    arrival = inbox.expect("req-1", TOKEN)
    await push
    assert (await arrival).first_token_id == 2


async def test_a_wrong_token_is_refused_and_the_waiting_request_keeps_waiting():
    inbox = KvInbox()
    arrival = inbox.expect("req-1", TOKEN)
    with pytest.raises(KvTransferError) as raised:
        await inbox.receive(as_stream(kv_chunks("req-1", b"x" * 32, [1], 2, sequence_kv())))
    assert raised.value.code is grpc.StatusCode.PERMISSION_DENIED
    assert not arrival.done()
    await inbox.receive(as_stream(kv_chunks("req-1", TOKEN, [1], 2, sequence_kv())))
    assert arrival.done()


async def test_a_token_works_once():
    inbox = KvInbox()
    inbox.expect("req-1", TOKEN)
    await inbox.receive(as_stream(kv_chunks("req-1", TOKEN, [1], 2, sequence_kv())))
    with pytest.raises(KvTransferError) as raised:
        await inbox.receive(as_stream(kv_chunks("req-1", TOKEN, [1], 2, sequence_kv())))
    assert raised.value.code is grpc.StatusCode.PERMISSION_DENIED


async def test_a_corrupted_cache_is_never_handed_to_decode():
    chunks = list(kv_chunks("req-1", TOKEN, [1], 2, sequence_kv()))
    tensor = chunks[3].tensor
    tensor.data = bytes([tensor.data[0] ^ 1]) + tensor.data[1:]
    inbox = KvInbox()
    arrival = inbox.expect("req-1", TOKEN)
    with pytest.raises(KvTransferError) as raised:
        await inbox.receive(as_stream(chunks))
    assert raised.value.code is grpc.StatusCode.DATA_LOSS
    with pytest.raises(KvTransferError, match="CRC-32"):
        await arrival


@pytest.mark.parametrize("cut", [1, 4, -1])
async def test_a_cut_off_stream_is_never_handed_to_decode(cut):
    chunks = list(kv_chunks("req-1", TOKEN, [1], 2, sequence_kv()))[:cut]
    inbox = KvInbox()
    arrival = inbox.expect("req-1", TOKEN)
    with pytest.raises(KvTransferError) as raised:
        await inbox.receive(as_stream(chunks))
    assert raised.value.code is grpc.StatusCode.DATA_LOSS
    assert arrival.done() and isinstance(arrival.exception(), KvTransferError)


async def test_a_push_nobody_waits_for_is_refused_quickly():
    inbox = KvInbox(arrival_timeout=0.1)
    with pytest.raises(KvTransferError) as raised:
        await inbox.receive(as_stream(kv_chunks("req-9", TOKEN, [1], 2, sequence_kv())))
    assert raised.value.code is grpc.StatusCode.FAILED_PRECONDITION
    assert "req-9" in str(raised.value)


async def test_a_stream_without_a_header_is_refused():
    chunks = list(kv_chunks("req-1", TOKEN, [1], 2, sequence_kv()))[1:]
    with pytest.raises(KvTransferError) as raised:
        await KvInbox().receive(as_stream(chunks))
    assert raised.value.code is grpc.StatusCode.INVALID_ARGUMENT
