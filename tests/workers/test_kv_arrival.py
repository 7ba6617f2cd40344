"""The connectors' own halves of the hand-shake, which the worker server only maps to gRPC statuses: a
decode call's wait for its KV (`DecodeConnector.arrival`) and a decode worker's data port asked for and
checked (`PrefillConnector.resolve`)."""

import asyncio

import grpc
import pytest

from diptych_common.worker_credential import WorkerSecret
from tests.workers.kv_wire import LAYOUT, TOKEN
from tests.workers.test_kv_delta import cached_prompt_manager
from tests.workers.test_kv_transfer import PoolRunner, send_in_background
from workers.engine.kv_transfer import Peer
from workers.kv_connector.decode import DecodeConnector
from workers.kv_connector.prefill import PrefillConnector
from workers.kv_connector.receiver import KvInbox, KvReceiver
from workers.kv_connector.sender import KvSender
from workers.kv_connector.timeouts import KvTimeouts
from workers.kv_connector.wire import KvTransferError

PROMPT = list(range(100, 120))  # 5 blocks of 4


@pytest.fixture
def connector():
    timeouts = KvTimeouts(io_s=0.5, arrival_s=0.3)
    receiver = KvReceiver(KvInbox(timeouts), LAYOUT, timeouts=timeouts)
    receiver.start()
    yield DecodeConnector(receiver)
    receiver.close()


async def test_a_cache_that_arrives_is_returned_and_stays_registered_until_forgotten(connector):
    sender = KvSender(LAYOUT, KvTimeouts(io_s=1.0))
    waiting = asyncio.ensure_future(connector.arrival("req-1", TOKEN, 8, timeout=5.0))
    await asyncio.sleep(0.05)
    outgoing = sender.open("req-1", TOKEN, PROMPT[:8], Peer(connector.receiver.host, connector.receiver.port, False))
    result = send_in_background(outgoing)
    outgoing.write_blocks(PoolRunner(), [3, 4], 0)
    outgoing.finish(7)
    received = await waiting
    assert received.first_token_id == 7 and received.prompt_token_ids == PROMPT[:8]
    assert result.get(timeout=5) == 2 * LAYOUT.block_nbytes
    connector.forget("req-1")


async def test_a_cache_that_never_comes_times_out_and_the_call_and_its_pinned_blocks_are_forgotten(connector):
    kv = cached_prompt_manager(PROMPT)
    with pytest.raises(KvTransferError, match="did not arrive in time") as raised:
        await connector.arrival("req-1", TOKEN, len(PROMPT), 0.1, kv, PROMPT)
    assert raised.value.code is grpc.StatusCode.DEADLINE_EXCEEDED
    assert kv.reserved_blocks("req-1") == 0
    with pytest.raises(KvTransferError, match="no decode request for req-1"):
        connector.receiver.inbox.claim("req-1", TOKEN)  # nothing waits any more


async def test_a_failed_transfer_says_why_and_forgets_the_call(connector):
    sender = KvSender(LAYOUT, KvTimeouts(io_s=1.0))
    waiting = asyncio.ensure_future(connector.arrival("req-1", TOKEN, 8, timeout=5.0))
    await asyncio.sleep(0.05)
    outgoing = sender.open("req-1", TOKEN, PROMPT[:8], Peer(connector.receiver.host, connector.receiver.port, False))
    send_in_background(outgoing)
    outgoing.abort("the prefill request was cancelled")
    with pytest.raises(KvTransferError, match=r"the KV cache transfer failed: .*was cancelled") as raised:
        await waiting
    assert raised.value.code is grpc.StatusCode.ABORTED


async def test_a_call_without_its_prompt_length_is_refused_before_anything_is_registered(connector):
    with pytest.raises(KvTransferError, match="prompt_tokens must give the prompt's length") as raised:
        await connector.arrival("req-1", TOKEN, 0, timeout=1.0)
    assert raised.value.code is grpc.StatusCode.INVALID_ARGUMENT
    connector.receiver.inbox.expect("req-1", TOKEN, lambda _: None, 8)  # the id is still free


async def test_a_decode_worker_that_cannot_be_reached_is_unavailable_and_not_remembered():
    connector = PrefillConnector(KvSender(LAYOUT))
    with pytest.raises(KvTransferError, match=r"could not reach the decode worker at 127.0.0.1:9") as raised:
        await connector.resolve("127.0.0.1:9", WorkerSecret("a secret"))
    assert raised.value.code is grpc.StatusCode.UNAVAILABLE
    assert connector.peer("127.0.0.1:9") is None
