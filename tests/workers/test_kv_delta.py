"""Prefill sends only the KV blocks its decode worker lacks: a conversation's next turn finds the previous
turn's prompt and output in the decode worker's prefix cache, which pins them when the decode call
registers; the prefill worker, told how many it holds, sends the rest. Greedy output stays equal to
`generate`'s, the pinned blocks go back on every path, and the gateway routes the turn to the holder."""

import asyncio
import json
import queue
import secrets
import socket
import struct
import threading
import time

import grpc
import pytest
import torch

from diptych_common.proto.v1 import worker_pb2
from diptych_common.worker_credential import WorkerSecret
from gateway.core.request_path import RequestPath
from gateway.core.trace import RequestTrace
from gateway.fleet.channels import Channels
from gateway.fleet.live_load import LoadBoard
from gateway.fleet.registry import ModelInfo, Registry, WorkerInfo
from gateway.routing.route import ServingMode
from gateway.routing.router import Router
from gateway.types import GenerationPlan, SamplingSpec
from tests.workers.conftest import prompts, wait_until
from tests.workers.kv_wire import LAYOUT, TOKEN
from tests.workers.serving import SECRET, Worker, sampling, split
from workers.engine.kv_cache_manager import KVCacheManager
from workers.engine.kv_transfer import KvTransferParams, Peer
from workers.engine.request import EngineRequest, FinishReason
from workers.engine.sampling import SamplingParams
from workers.engine.schedule import ScheduledChunk, SchedulerOutput
from workers.kv_connector.decode import DecodeConnector
from workers.kv_connector.prefill import PrefillConnector
from workers.kv_connector.receiver import KvInbox, KvReceiver, ReceivedKv
from workers.kv_connector.sender import KvSender
from workers.kv_connector.timeouts import KvTimeouts
from workers.kv_connector.wire import (
    FIRST_BLOCK,
    FRAME,
    TOKEN_ID,
    KvTransferError,
    checksum,
    encode_hello,
    recv_exact,
    recv_json,
    send_json,
)
from workers.runner.kv_pool import BlocksRead
from workers.serving.server import Role

BLOCK = 16  # the serving workers' block size


# ---- helpers --------------------------------------------------------------------------------------


async def turn(prefill, decode, request_id: str, prompt: list[int], count: int, cache_salt: str = "", whole=False):
    """One split request as the gateway runs it: the decode call gives its prompt (unless `whole`, as an
    older gateway does). Returns (output tokens, kv bytes delivered)."""
    events, rest = await split(prefill, decode, request_id, prompt, count, cache_salt, give_prompt=not whole)
    return [events[0].first_token.token_id] + [e.token_id for e in rest], events[1].kv_delivered.kv_bytes


def held_after(first_prompt: list[int], first_output: list[int], next_prompt: list[int]) -> int:
    """The blocks of `next_prompt` a decode worker holds after serving the first turn: the full blocks it
    computed (every token but the last output) that start `next_prompt`, at most (len - 1) // BLOCK."""
    computed = len(first_prompt) + len(first_output) - 1
    return min(computed // BLOCK, (len(next_prompt) - 1) // BLOCK)


def blocks(num_tokens: int) -> int:
    return -(-num_tokens // BLOCK)


def free_blocks(worker) -> int:
    return worker.engine.stats().kv_blocks_free


@pytest.fixture
async def decode_worker(tiny_model, executor):
    decode = Worker(Role.DECODE, tiny_model, executor, allow_shm=False)
    await decode.start()
    yield decode
    await decode.stop()


# ---- the second turn ------------------------------------------------------------------------------


async def test_a_second_turn_sends_only_the_blocks_the_decode_worker_lacks(workers, reference):
    prefill, decode = workers
    block_nbytes = decode.engine.runner.layout.block_nbytes
    first_prompt = prompts([70], salt=31)[0]
    first_output, sent = await turn(prefill, decode, "t1", first_prompt, 12, "org-a")
    assert first_output == reference(first_prompt, 12) and sent == blocks(70) * block_nbytes
    second_prompt = first_prompt + first_output + prompts([21], salt=32)[0]
    received_before = decode.engine.stats().kv_bytes_received
    output, sent = await turn(prefill, decode, "t2", second_prompt, 9, "org-a")
    held = held_after(first_prompt, first_output, second_prompt)
    assert held == 5
    # The prefill worker computes the new tokens in one chunk from its own prefix hit (blocks 4 to 6), and a
    # chunk leaves whole: staged before the decode worker's answer named the held blocks, it brings block 4.
    prefill_hit = len(first_prompt) // BLOCK
    assert sent in {(blocks(len(second_prompt)) - first) * block_nbytes for first in (held, prefill_hit)}
    assert decode.engine.stats().kv_bytes_received - received_before == sent
    # The same turn sent whole (a gateway that gives no prompt) decodes the same tokens as generate.
    whole_output, whole_sent = await turn(prefill, decode, "t2-whole", second_prompt, 9, "org-a", whole=True)
    assert whole_sent == blocks(len(second_prompt)) * block_nbytes
    assert output == whole_output == reference(second_prompt, 9)
    assert await wait_until(lambda: free_blocks(decode) == decode.engine.kv.num_blocks)


async def test_another_organizations_identical_prompt_gets_the_whole_cache(workers, reference):
    prefill, decode = workers
    block_nbytes = decode.engine.runner.layout.block_nbytes
    first_prompt = prompts([64], salt=33)[0]
    first_output, _ = await turn(prefill, decode, "a1", first_prompt, 10, "org-a")
    second_prompt = first_prompt + first_output + [7, 8, 9]
    output, sent = await turn(prefill, decode, "b2", second_prompt, 5, "org-b")
    assert sent == blocks(len(second_prompt)) * block_nbytes  # org-b holds nothing of org-a's
    assert output == reference(second_prompt, 5)
    output, sent = await turn(prefill, decode, "a2", second_prompt, 5, "org-a")
    assert sent == (blocks(len(second_prompt)) - held_after(first_prompt, first_output, second_prompt)) * block_nbytes
    assert output == reference(second_prompt, 5)


async def test_pinned_blocks_survive_pressure_that_would_evict_them(workers, reference):
    prefill, decode = workers
    first_prompt = prompts([90], salt=34)[0]
    first_output, _ = await turn(prefill, decode, "p1", first_prompt, 8)
    second_prompt = first_prompt + first_output + [5, 6, 7, 8]
    held = held_after(first_prompt, first_output, second_prompt)
    token = secrets.token_bytes(32)
    decode_call = decode.stub.Decode(
        worker_pb2.DecodeRequest(
            request_id="p2",
            transfer_token=token,
            sampling=sampling(6),
            prompt_tokens=len(second_prompt),
            prompt_token_ids=second_prompt,
        )
    )
    total = decode.engine.kv.num_blocks
    assert await wait_until(lambda: free_blocks(decode) == total - held)  # pinned
    # Two long prompts on the decode worker take 126 blocks between them: without the pin, the oldest
    # free blocks, the first turn's, would be handed out and overwritten.
    for index, pressure in enumerate(prompts([1000], salt=35) + prompts([1000], salt=38)):
        events = [
            e
            async for e in decode.stub.Generate(
                worker_pb2.GenerateWork(request_id=f"g{index}", prompt_token_ids=pressure, sampling=sampling(8))
            )
        ]
        assert len(events) == 8
    prefill_events = [
        e
        async for e in prefill.stub.Prefill(
            worker_pb2.PrefillRequest(
                request_id="p2",
                prompt_token_ids=second_prompt,
                sampling=sampling(6),
                decode_address=decode.address,
                transfer_token=token,
            )
        )
    ]
    rest = [e.token_id async for e in decode_call]
    moved = prefill_events[1].kv_delivered.kv_bytes // decode.engine.runner.layout.block_nbytes
    # The blocks the decode worker lacks; or, when the prefill worker staged its step before the decode
    # worker's answer came, those from the end of its own prefix hit (the first turn's prompt): a chunk
    # staged across the held end leaves whole. Never the whole prompt.
    assert moved in (blocks(len(second_prompt)) - held, blocks(len(second_prompt)) - len(first_prompt) // BLOCK)
    assert [prefill_events[0].first_token.token_id, *rest] == reference(second_prompt, 6)


# ---- the pin goes back on every path --------------------------------------------------------------


async def served_first_turn(decode_worker, prompt: list[int]) -> None:
    """The decode worker computes `prompt` (a colocated Generate names its blocks as a decode would)."""
    request = worker_pb2.GenerateWork(request_id="warm", prompt_token_ids=prompt, sampling=sampling(2))
    assert len([e async for e in decode_worker.stub.Generate(request)]) == 2


def register(decode_worker, request_id: str, token: bytes, prompt: list[int], timeout: float | None = None):
    return decode_worker.stub.Decode(
        worker_pb2.DecodeRequest(
            request_id=request_id,
            transfer_token=token,
            sampling=sampling(4),
            prompt_tokens=len(prompt),
            prompt_token_ids=prompt,
        ),
        timeout=timeout,
    )


class RealLayoutSender:
    """A prefill worker's side of the data path written by hand, for the decode worker under test."""

    def __init__(self, decode_worker, request_id: str, token: bytes, prompt: list[int]) -> None:
        self.layout = decode_worker.engine.runner.layout
        receiver = decode_worker.receiver
        self.sock = socket.create_connection((receiver.host, receiver.port), timeout=5)
        self.sock.sendall(encode_hello(request_id, token, self.layout, len(prompt), "tcp", ""))
        self.reply = recv_json(self.sock, "reply")
        self.prompt = prompt

    def start(self, first_block: int) -> None:
        self.sock.sendall(FIRST_BLOCK.pack(first_block) + struct.pack(f"<{len(self.prompt)}I", *self.prompt))

    def chunk(self, first: int, count: int, corrupt: bool = False) -> None:
        payload = torch.randn(count * self.layout.block_nbytes // 4).numpy().tobytes()
        digest = checksum(payload) ^ int(corrupt)
        self.sock.sendall(FRAME.pack(b"C", first, count, 0, digest) + payload)


async def assert_pin_released(decode_worker, call, code: grpc.StatusCode) -> None:
    with pytest.raises(grpc.aio.AioRpcError) as failed:
        async for _ in call:
            pass
    assert failed.value.code() is code
    total = decode_worker.engine.kv.num_blocks
    assert await wait_until(lambda: free_blocks(decode_worker) == total)


async def test_a_cancelled_call_releases_its_pinned_blocks(decode_worker):
    prompt = prompts([100], salt=36)[0]
    await served_first_turn(decode_worker, prompt)
    call = register(decode_worker, "c", b"k" * 32, [*prompt, 9, 9])
    total = decode_worker.engine.kv.num_blocks
    assert await wait_until(lambda: free_blocks(decode_worker) == total - 6)
    call.cancel()
    assert await wait_until(lambda: free_blocks(decode_worker) == total)
    assert decode_worker.engine.kv.reserved_blocks("c") == 0


async def test_a_call_whose_kv_never_comes_releases_its_pinned_blocks_at_its_deadline(decode_worker):
    prompt = prompts([100], salt=36)[0]
    await served_first_turn(decode_worker, prompt)
    call = register(decode_worker, "late", b"k" * 32, [*prompt, 9, 9], timeout=1.0)
    total = decode_worker.engine.kv.num_blocks
    assert await wait_until(lambda: free_blocks(decode_worker) == total - 6)
    await assert_pin_released(decode_worker, call, grpc.StatusCode.DEADLINE_EXCEEDED)


@pytest.mark.parametrize("how", ["corrupt", "prefill-died"])
async def test_a_failed_transfer_releases_its_pinned_blocks(decode_worker, how):
    prompt = prompts([100], salt=36)[0] + [9, 9]
    await served_first_turn(decode_worker, prompt[:100])
    token = secrets.token_bytes(32)
    call = register(decode_worker, "f", token, prompt)
    total = decode_worker.engine.kv.num_blocks
    assert await wait_until(lambda: free_blocks(decode_worker) == total - 6)
    sender = await asyncio.to_thread(RealLayoutSender, decode_worker, "f", token, prompt)
    assert sender.reply == {"ok": True, "held_blocks": 6}
    sender.start(6)
    if how == "corrupt":
        sender.chunk(6, 1, corrupt=True)
        code = grpc.StatusCode.DATA_LOSS
    else:
        sender.chunk(6, 1)
        sender.sock.close()  # the prefill worker died mid-stream
        code = grpc.StatusCode.DATA_LOSS
    await assert_pin_released(decode_worker, call, code)
    sender.sock.close()


async def test_a_decode_call_whose_prompt_does_not_match_its_length_is_refused_and_pins_nothing(decode_worker):
    prompt = prompts([100], salt=36)[0]
    await served_first_turn(decode_worker, prompt)
    call = decode_worker.stub.Decode(
        worker_pb2.DecodeRequest(
            request_id="bad",
            transfer_token=b"k" * 32,
            sampling=sampling(4),
            prompt_tokens=len(prompt) + 2,
            prompt_token_ids=prompt,
        )
    )
    with pytest.raises(grpc.aio.AioRpcError) as refused:
        async for _ in call:
            pass
    assert refused.value.code() is grpc.StatusCode.INVALID_ARGUMENT
    assert "gives 100 prompt token ids for a prompt of 102" in refused.value.details()
    assert free_blocks(decode_worker) == decode_worker.engine.kv.num_blocks


# ---- the data path's checks -----------------------------------------------------------------------


class StagingRunner:
    """A KV pool of 20 blocks in LAYOUT, read by copying (as from a GPU pool)."""

    def __init__(self) -> None:
        self.kv = torch.randn(2, 2, 20, 4, 2, 8, generator=torch.Generator().manual_seed(1))

    def read_blocks(self, block_ids, out) -> None:
        torch.index_select(self.kv, 2, torch.tensor(block_ids), out=out)

    def start_reading_blocks(self, block_ids, out) -> BlocksRead:
        self.read_blocks(block_ids, out)
        return BlocksRead()  # a host pool: the copy is done


HAND_OFF_TIMEOUTS = KvTimeouts(io_s=1.0, arrival_s=2.0, hello_answer_s=3.0)  # both sides of the transfers


@pytest.fixture
def receiver():
    rx = KvReceiver(KvInbox(HAND_OFF_TIMEOUTS), LAYOUT, timeouts=HAND_OFF_TIMEOUTS)
    rx.start()
    yield rx
    rx.close()


@pytest.fixture(params=[False, True], ids=["tcp", "shm"])
def sender(request):
    tx = KvSender(LAYOUT, HAND_OFF_TIMEOUTS)
    tx.send_from_pool = False  # chunks copied to host buffers (the shm path always is)
    tx.allow_shm = request.param
    yield tx
    tx.close()


def send_in_background(outgoing) -> queue.Queue:
    """The transfer's outcome (bytes sent, or the KvTransferError) arrives on the queue."""
    result: queue.Queue = queue.Queue()

    def run() -> None:
        try:
            result.put(outgoing.send())
        except KvTransferError as error:
            result.put(error)

    threading.Thread(target=run, daemon=True).start()
    return result


def outcome(result: queue.Queue):
    return result.get(timeout=10)


PROMPT = list(range(3, 20))  # 17 tokens: 5 blocks of 4; at most 4 held


@pytest.mark.parametrize(
    ("staged_before", "held", "first"),
    [((), 3, 3), ((2, 4), 3, 2), ((4,), 4, 4), ((1, 2, 3), 3, 3)],
    ids=["answer-first", "a-chunk-runs-across", "a-chunk-ends-there", "chunks-end-there"],
)
def test_the_transfer_starts_where_the_receiver_lacks_blocks(receiver, sender, staged_before, held, first):
    """Chunks staged before the answer leave whole or not at all; those after are cut at the held end."""
    runner = StagingRunner()
    arrived: list = []
    outgoing = sender.open("req-1", TOKEN, PROMPT, Peer(receiver.host, receiver.port, sender.allow_shm))
    result = send_in_background(outgoing)
    start = 0
    for end in staged_before:  # the decode call has not registered yet: no answer can have come
        outgoing.write_blocks(runner, list(range(start, end)), start)
        start = end
    receiver.inbox.expect("req-1", TOKEN, arrived.append, len(PROMPT), held, tuple(PROMPT))
    assert wait_for(lambda: outgoing.first_block is not None)
    outgoing.write_blocks(runner, list(range(start, 5)), start)
    outgoing.finish(42)
    assert outcome(result) == (5 - first) * LAYOUT.block_nbytes
    received = arrived[0]
    assert isinstance(received, ReceivedKv) and received.first_block == first
    assert received.chunks[0].first_block == first
    whole = torch.cat([chunk.data for chunk in received.chunks], dim=2)
    assert torch.equal(whole, runner.kv[:, :, first:5])
    assert receiver.bytes_received == (5 - first) * LAYOUT.block_nbytes
    received.release()


def wait_for(condition, timeout: float = 5.0) -> bool:
    """Whether `condition` holds within `timeout` seconds (for tests on plain threads)."""
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.002)
    return True


class HandReceiver:
    """A decode worker's data port written by hand: answers the hello with `reply`, then records what
    the sender sent up to its first frame (a first block only after a reply that says what it holds)."""

    def __init__(self, reply: dict) -> None:
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port = self._listener.getsockname()[1]
        self.reply = reply
        self.first_block: int | None = None
        self.prompt: list[int] = []
        self.first_frame: tuple[bytes, int] | None = None
        self.abort_reason: str | None = None
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        conn, _ = self._listener.accept()
        with conn:
            conn.settimeout(5)
            recv_exact(conn, 4, "magic")
            recv_json(conn, "hello")
            send_json(conn, self.reply)
            if "held_blocks" in self.reply:
                (self.first_block,) = FIRST_BLOCK.unpack(recv_exact(conn, FIRST_BLOCK.size, "first block"))
            ids = recv_exact(conn, len(PROMPT) * TOKEN_ID.size, "prompt")
            self.prompt = [token for (token,) in TOKEN_ID.iter_unpack(ids)]
            kind, first, *_ = FRAME.unpack(recv_exact(conn, FRAME.size, "frame"))
            if kind == b"X":
                self.abort_reason = recv_json(conn, "reason")["reason"]
            self.first_frame = (kind, first)
        self._listener.close()


def test_a_prefix_hit_leaves_as_a_chunk_of_its_own_so_a_late_answer_still_skips_it(receiver, sender):
    """The prefill worker found 3 of the prompt's 5 blocks in its prefix cache and computes the rest in one
    step, which it stages before the receiver's answer can have come. The hit is a chunk of its own, so a
    receiver that holds those 3 blocks still gets only the 2 after them (one chunk from block 0 would have
    had to leave whole)."""
    kv, connector, arrived = KVCacheManager(20, 4), PrefillConnector(sender), []
    peer = Peer(receiver.host, receiver.port, sender.allow_shm)
    request = EngineRequest(
        "req-1",
        PROMPT,
        SamplingParams(max_tokens=1),
        prefill_only=True,
        kv_transfer=KvTransferParams(send_to=peer, transfer_token=TOKEN),
    )
    sent = connector.add_request(request)
    assert sent is not None and kv.allocate("req-1", len(PROMPT))
    request.num_cached_tokens = 12  # the scheduler's count of the hit, set at admission
    meta = connector.build_meta(SchedulerOutput([ScheduledChunk(request, 12, len(PROMPT) - 12)]), kv)
    assert [(save.first_block, len(save.block_ids)) for save in meta.saves] == [(0, 3), (3, 2)]
    connector.save_kv(meta, StagingRunner())
    receiver.inbox.expect("req-1", TOKEN, arrived.append, len(PROMPT), 3, tuple(PROMPT))
    request.output_token_ids.append(7)
    request.finish_reason = FinishReason.HANDED_OFF
    connector.request_finished(request)
    assert sent.result(timeout=10).nbytes == 2 * LAYOUT.block_nbytes


def test_an_older_receiver_that_says_nothing_of_held_blocks_gets_every_block(sender):
    hand = HandReceiver({"ok": True})
    outgoing = sender.open("req-1", TOKEN, PROMPT, Peer("127.0.0.1", hand.port, False))
    send_in_background(outgoing)
    outgoing.write_blocks(StagingRunner(), [0, 1, 2, 3, 4], 0)
    assert wait_for(lambda: hand.first_frame is not None)
    assert hand.first_block is None and hand.prompt == PROMPT  # no first block before the prompt
    assert hand.first_frame == (b"C", 0) and outgoing.first_block == 0


@pytest.mark.parametrize("claim", [5, -1, "2", True, 2.0])
def test_a_reply_claiming_more_blocks_than_allowed_is_refused(sender, claim):
    hand = HandReceiver({"ok": True, "held_blocks": claim})
    outgoing = sender.open("req-1", TOKEN, PROMPT, Peer("127.0.0.1", hand.port, False))
    error = outcome(send_in_background(outgoing))
    assert isinstance(error, KvTransferError) and error.code is grpc.StatusCode.INVALID_ARGUMENT
    assert "may hold a whole number from 0 to 4" in str(error)
    assert wait_for(lambda: hand.abort_reason is not None)
    assert hand.first_block == 0 and "claims to hold" in hand.abort_reason


@pytest.mark.parametrize(
    ("first_block", "prompt", "frame_first", "match"),
    [
        (3, None, None, "starts at block 3, but this worker holds only the first 2"),
        (2, [PROMPT[0] + 1, *PROMPT[1:]], None, "another prompt than the one its decode request declared"),
        (2, PROMPT, 3, "out of order"),
        (2, PROMPT, 1, "out of order"),
    ],
    ids=["starts-after-the-held-blocks", "another-prompt", "a-gap", "an-overlap"],
)
def test_the_receiver_refuses_a_stream_that_does_not_start_where_its_held_blocks_end(
    receiver, first_block, prompt, frame_first, match
):
    """Each message is sent only up to what the receiver refuses (nothing left unread)."""
    arrived: list = []
    receiver.inbox.expect("req-1", TOKEN, arrived.append, len(PROMPT), 2, tuple(PROMPT))
    sock = socket.create_connection((receiver.host, receiver.port), timeout=5)
    sock.sendall(encode_hello("req-1", TOKEN, LAYOUT, len(PROMPT), "tcp", ""))
    assert recv_json(sock, "reply") == {"ok": True, "held_blocks": 2}
    sock.sendall(FIRST_BLOCK.pack(first_block))
    if prompt is not None:
        sock.sendall(struct.pack(f"<{len(prompt)}I", *prompt))
    if frame_first is not None:
        sock.sendall(FRAME.pack(b"C", frame_first, 1, 0, 0))
    reply = recv_json(sock, "verdict")
    sock.close()
    assert reply["ok"] is False and match in reply["error"], reply
    assert wait_for(lambda: bool(arrived)) and isinstance(arrived[0], KvTransferError)


def test_the_receiver_never_offers_the_block_of_the_last_token(receiver):
    receiver.inbox.expect("req-1", TOKEN, lambda result: None, len(PROMPT), 5, tuple(PROMPT))
    sock = socket.create_connection((receiver.host, receiver.port), timeout=5)
    sock.sendall(encode_hello("req-1", TOKEN, LAYOUT, len(PROMPT), "tcp", ""))
    assert recv_json(sock, "reply") == {"ok": True, "held_blocks": 4}  # (17 - 1) // 4
    sock.close()


def test_an_older_sender_gets_no_held_blocks_and_sends_everything(receiver):
    arrived: list = []
    receiver.inbox.expect("req-1", TOKEN, arrived.append, len(PROMPT), 3, tuple(PROMPT))
    header = json.loads(encode_hello("req-1", TOKEN, LAYOUT, len(PROMPT), "tcp", "")[8:])
    del header["skip_held"]
    body = json.dumps(header).encode()
    sock = socket.create_connection((receiver.host, receiver.port), timeout=5)
    sock.sendall(b"DKV2" + struct.pack("<I", len(body)) + body)
    assert recv_json(sock, "reply") == {"ok": True}
    sock.sendall(struct.pack(f"<{len(PROMPT)}I", *PROMPT))
    payload = bytes(5 * LAYOUT.block_nbytes)
    sock.sendall(FRAME.pack(b"C", 0, 5, 0, checksum(payload)) + payload + FRAME.pack(b"E", 7, 0, 0, 0))
    assert recv_json(sock, "verdict")["ok"] is True
    sock.close()
    assert wait_for(lambda: bool(arrived)) and arrived[0].first_block == 0 and arrived[0].nbytes == len(payload)
    arrived[0].release()


def cached_prompt_manager(tokens: list[int]) -> KVCacheManager:
    """A KV cache manager in LAYOUT's block size whose prefix cache holds `tokens`' full blocks, freed."""
    kv = KVCacheManager(num_blocks=20, block_size=LAYOUT.block_size)
    assert kv.allocate("earlier", len(tokens))
    kv.cache_full_blocks("earlier", tokens, len(tokens))
    kv.free("earlier")
    return kv


def test_the_decode_connector_keeps_the_blocks_the_transfer_skipped_and_gives_back_the_rest(receiver, sender):
    """The receiver holds 4 blocks, but a chunk staged before its answer runs from block 2: the request's
    reservation shrinks to 2 when the engine takes it, and goes back whole if it leaves before admission."""
    kv = cached_prompt_manager(PROMPT)
    connector = DecodeConnector(receiver)
    arrival = connector.expect("req-1", TOKEN, len(PROMPT), kv, PROMPT)
    assert kv.reserved_blocks("req-1") == 4 and kv.num_free_blocks == 16
    outgoing = sender.open("req-1", TOKEN, PROMPT, Peer(receiver.host, receiver.port, sender.allow_shm))
    runner = StagingRunner()
    outgoing.write_blocks(runner, [0, 1], 0)  # both staged before the transfer connects
    outgoing.write_blocks(runner, [5, 6, 7], 2)
    result = send_in_background(outgoing)
    outgoing.finish(42)
    assert outcome(result) == 3 * LAYOUT.block_nbytes
    assert arrival.result(timeout=5).first_block == 2
    request = EngineRequest(
        "req-1",
        PROMPT,
        SamplingParams(temperature=0.0, max_tokens=2),
        output_token_ids=[42],
        kv_transfer=KvTransferParams(load_tokens=len(PROMPT)),
    )
    connector.add_request(request)
    connector.forget("req-1")  # the call is done registering: the engine owns what it took
    assert kv.reserved_blocks("req-1") == 2 and kv.num_free_blocks == 18
    connector.request_finished(request)  # it left before it was admitted
    assert kv.reserved_blocks("req-1") == 0 and kv.num_free_blocks == 20


# ---- the reservation in the KV cache manager ------------------------------------------------------


def test_a_reservation_pins_the_held_prefix_and_becomes_the_block_table():
    kv = KVCacheManager(num_blocks=8, block_size=4)
    tokens = list(range(10, 23))  # 13 tokens: 3 full blocks
    assert kv.allocate("first", 13)
    kv.cache_full_blocks("first", tokens, 13, "org")
    held_ids = kv.block_ids("first")[:3]
    kv.free("first")
    assert kv.num_free_blocks == 8
    assert kv.reserve_prefix("next", [*tokens, 1, 2], "other-org") == 0  # named under another salt
    kv.release_reservation("next")
    assert kv.reserve_prefix("next", [*tokens, 1, 2], "org") == 3
    assert kv.num_free_blocks == 5
    assert kv.allocate("pressure", 20)  # every free block: the reserved ones are not among them
    assert not set(kv.block_ids("pressure")) & set(held_ids)
    kv.free("pressure")
    kv.trim_reservation("next", 2)  # the sender started at block 2
    assert kv.num_free_blocks == 6 and kv.reserved_blocks("next") == 2
    assert kv.allocate_reserved("next", 16)
    assert kv.block_ids("next")[:2] == held_ids[:2] and len(kv.block_ids("next")) == 4
    assert kv.reserved_blocks("next") == 0 and kv.num_free_blocks == 4
    kv.free("next")
    assert kv.num_free_blocks == 8
    kv.reserve_prefix("x", tokens, "org")
    with pytest.raises(ValueError, match="already holds"):
        kv.reserve_prefix("x", tokens, "org")


# ---- the gateway ----------------------------------------------------------------------------------


async def test_the_gateway_routes_the_next_turn_to_the_decode_worker_that_holds_it(tiny_model, executor, reference):
    prefill = Worker(Role.PREFILL, tiny_model, executor, allow_shm=False)
    holder = Worker(Role.DECODE, tiny_model, executor, allow_shm=False)
    other = Worker(Role.DECODE, tiny_model, executor, allow_shm=False)
    for worker in (prefill, holder, other):
        await worker.start()
    infos = {
        "p": WorkerInfo("p", "prefill", "m", "local", prefill.address, "ready", 0, 0),
        "d-a": WorkerInfo("d-a", "decode", "m", "local", other.address, "ready", 0, 0),  # wins a tie
        "d-b": WorkerInfo("d-b", "decode", "m", "local", holder.address, "ready", 0, 0),
    }
    by_id = {"p": prefill, "d-a": other, "d-b": holder}
    channels = Channels(WorkerSecret(SECRET))
    board = LoadBoard(channels)
    registry = Registry(control_plane=None)
    registry.workers = list(infos.values())
    path = RequestPath(channels, board, Router(registry, board, ServingMode.SPLIT))
    try:
        first_prompt = prompts([80], salt=37)[0]
        first_output, _ = await turn(prefill, holder, "c1", first_prompt, 10, "org_1")
        second_prompt = first_prompt + first_output + [11, 12, 13]
        for worker_id, worker in by_id.items():
            board.report(infos[worker_id], worker.service.load().to_proto())
        plan = GenerationPlan(
            request_id="exec_2",
            organization_id="org_1",
            model=ModelInfo("m", "builtin", 1024),
            tokenizer=None,
            prompt_token_ids=second_prompt,
            sampling=SamplingSpec(temperature=0.0, max_tokens=6, ignore_eos=True),
            stop=[],
        )
        trace = RequestTrace()
        tokens = [event.token_id async for arrived in path.run(plan, trace) for event in arrived]
        assert tokens == reference(second_prompt, 6)
        assert trace.decode is not None and trace.decode.worker.id == "d-b"
        held = held_after(first_prompt, first_output, second_prompt)
        moved = (blocks(len(second_prompt)) - held) * holder.engine.runner.layout.block_nbytes
        assert trace.prefill is not None and trace.prefill.kv_bytes == trace.decode.kv_bytes == moved
    finally:
        await channels.close()
        for worker in (prefill, holder, other):
            await worker.stop()
